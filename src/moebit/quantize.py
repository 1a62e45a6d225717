"""Weight-only int8 experts: per-output-channel symmetric scales, a drop-in for ``Experts``.

    report = quantize_experts_(model)     # every MoE layer's experts, in place
    print(report)                         # expert weight bytes before / after

Why experts only: in an MoE model they are almost all of the parameters (64 experts of a
[d, 4d] MLP per MoE layer against one attention block), and at decoding time a step reads
the weights of the experts its few tokens chose: the step is bound by weight bytes, which
int8 cuts 4x. Scales are per output channel (one per column of ``x @ w``), so one large
weight only coarsens its own channel: |w - q*s| <= s/2 with s = max|w[:, j]| / 127.

Two kernels, chosen per expert block by its row count (measured on this CPU, 2 threads):
- few rows (decoding): ``torch._weight_int8pack_mm`` reads the int8 weight directly with
  bf16 activations (at 1-4 rows, d 512, f 2048: 0.16-0.45 ms against 0.3-1.0 ms for the
  fp32 matmul); its fp32-activation variant is 10-100x slower here, so inputs go to bf16.
- many rows (prefill, evaluation): the block's weight is dequantized to the activation
  dtype once and multiplied there; the conversion is amortised over the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moebit.moe import MoE
from moebit.moe.experts import Experts

SMALL_ROWS = 16  # at most this many rows of one expert: the int8 kernel; more: dequantize


def quantize_per_channel(w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, K, N] float weights (x @ w) -> int8 [E, N, K] (output-major) and float32 scales [E, N]."""
    w = w_EKN.detach().float()
    s_EN = w.abs().amax(dim=1) / 127.0
    safe_EN = torch.where(s_EN > 0, s_EN, torch.ones_like(s_EN))
    q_EKN = torch.round(w / safe_EN[:, None, :]).clamp_(-127, 127).to(torch.int8)
    return q_EKN.transpose(1, 2).contiguous(), s_EN


def dequantize(q_ENK: torch.Tensor, s_EN: torch.Tensor) -> torch.Tensor:
    """Back to float [E, K, N] (for error checks and the many-rows kernel)."""
    return (q_ENK.float() * s_EN[:, :, None]).transpose(1, 2)


def _has_int8_kernel() -> bool:
    try:
        torch._weight_int8pack_mm(torch.zeros(1, 8, dtype=torch.bfloat16),
                                  torch.zeros(8, 8, dtype=torch.int8),
                                  torch.ones(8, dtype=torch.bfloat16))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def int8_linear(x_RK: torch.Tensor, q_NK: torch.Tensor, s_N: torch.Tensor, b_N: torch.Tensor,
                kernel: str = "auto", s_bf16_N: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(q).T + b`` in x's dtype; kernel "int8" (bf16 activations), "dequant" or "auto"."""
    rows = x_RK.shape[0]
    if kernel == "int8" or (kernel == "auto" and rows <= SMALL_ROWS and _INT8_OK):
        s = s_bf16_N if s_bf16_N is not None else s_N
        s = s if s.dtype == torch.bfloat16 else s.to(torch.bfloat16)  # model.to() may cast it
        y = torch._weight_int8pack_mm(x_RK.to(torch.bfloat16).contiguous(), q_NK, s)
        return y.to(x_RK.dtype).add_(b_N.to(x_RK.dtype))
    y = torch.mm(x_RK, q_NK.t().to(x_RK.dtype))
    return y.mul_(s_N.to(x_RK.dtype)).add_(b_N.to(x_RK.dtype))


_INT8_OK = _has_int8_kernel()


class Int8Experts(nn.Module):
    """The local experts of an ``Experts`` with int8 weights; same ``forward(x_ND, counts)``.

    Inference only (no backward). Biases stay float32: they are E*(d+f) numbers.
    """

    def __init__(self, experts: nn.Module, kernel: str = "auto") -> None:
        super().__init__()
        if kernel not in ("auto", "int8", "dequant"):
            raise ValueError(f"kernel must be auto, int8 or dequant, got {kernel!r}")
        self.num_experts, self.first_expert = experts.num_experts, experts.first_expert
        self.num_local, self.d_model, self.d_ffn = experts.num_local, experts.d_model, experts.d_ffn
        self.kernel = kernel
        q1, s1 = quantize_per_channel(experts.w1)
        q2, s2 = quantize_per_channel(experts.w2)
        for name, t in (("q1", q1), ("s1", s1), ("q2", q2), ("s2", s2),
                        ("b1", experts.b1.detach().float()), ("b2", experts.b2.detach().float())):
            self.register_buffer(name, t.clone())
        self.register_buffer("s1_bf16", s1.to(torch.bfloat16))
        self.register_buffer("s2_bf16", s2.to(torch.bfloat16))

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.q1, self.s1, self.q2, self.s2,
                                                          self.b1, self.b2))

    @torch.no_grad()
    def forward(self, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if len(counts) != self.num_local:
            raise ValueError(f"got {len(counts)} block sizes for {self.num_local} local experts")
        if sum(counts) != x_ND.shape[0]:
            raise ValueError(f"block sizes sum to {sum(counts)} but x has {x_ND.shape[0]} rows")
        out_ND = x_ND.new_empty(x_ND.shape)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            x_nD = x_ND[start:start + n]
            h_nF = F.gelu(int8_linear(x_nD, self.q1[e], self.s1[e], self.b1[e], self.kernel,
                                      self.s1_bf16[e]))
            out_ND[start:start + n] = int8_linear(h_nF, self.q2[e], self.s2[e], self.b2[e],
                                                  self.kernel, self.s2_bf16[e])
            start += n
        return out_ND

    def extra_repr(self) -> str:
        return (f"int8 experts {self.first_expert}..{self.first_expert + self.num_local - 1} of "
                f"{self.num_experts}, d_model={self.d_model}, d_ffn={self.d_ffn}, kernel={self.kernel}")


@dataclass
class QuantizeReport:
    layers: int  # MoE layers quantized
    bytes_before: int  # this rank's expert weights and biases before
    bytes_after: int  # int8 weights + float32 scales and biases

    @property
    def ratio(self) -> float:
        return self.bytes_before / max(1, self.bytes_after)

    def __str__(self) -> str:
        return (f"int8 experts: {self.layers} MoE layers, expert weights {self.bytes_before / 1e6:.2f} MB "
                f"-> {self.bytes_after / 1e6:.2f} MB ({self.ratio:.2f}x smaller)")


def quantize_experts_(model: nn.Module, kernel: str = "auto") -> QuantizeReport:
    """Replace every MoE layer's ``Experts`` by ``Int8Experts`` in place; dense layers untouched."""

    layers = before = after = 0
    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.experts, Experts):
            ex = m.experts
            if ex.expert_type != "gelu_mlp" or not ex.has_bias:
                raise ValueError(f"int8 experts support expert_type 'gelu_mlp' with biases only, "
                                 f"got {ex.expert_type!r} (expert_bias={ex.has_bias})")
            before += sum(p.numel() * p.element_size() for p in ex.parameters())
            q = Int8Experts(ex, kernel).to(ex.w1.device)
            m.experts = q
            after += q.weight_bytes()
            layers += 1
    if layers == 0:
        raise ValueError("the model has no MoE layer with float experts to quantize")
    return QuantizeReport(layers, before, after)
