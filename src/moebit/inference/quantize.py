"""Weight-only int8 experts: per-output-channel symmetric scales, a drop-in for ``Experts``.

    report = quantize_experts_(model)     # every MoE layer's experts, in place
    print(report)                         # expert weight bytes before / after

Why experts only: in an MoE model they are almost all of the parameters (64 experts of a
[d, 4d] MLP per MoE layer against one attention block), and at decoding time a step reads
the weights of the experts its few tokens chose: the step is bound by weight bytes, which
int8 cuts 4x. Scales are per output channel (one per column of ``x @ w``), so one large
weight only coarsens its own channel: |w - q*s| <= s/2 with s = max|w[:, j]| / 127.

Every expert type is covered: ``gelu_mlp`` (with or without biases) and the gated
``swiglu`` / ``geglu`` experts (Mixtral, Qwen-MoE, OLMoE: the Hugging Face decoder's), whose
fused ``gate_up_proj`` [E, 2f, d] is quantized per row (each row is one output channel of
the gate or the up projection) and ``down_proj`` [E, d, f] likewise. The activation runs
in the activation dtype on the dequantized products, so the error of a whole expert is
the two linears' bounds carried through the activation (docs/inference.md states both;
``tests/test_quantize_experts.py`` checks them).

Two kernels, chosen per expert block by its row count (measured on this CPU, 1-2 threads):
- few rows (decoding): ``torch._weight_int8pack_mm`` reads the int8 weight directly with
  bf16 activations (d 512, f 2720 gate_up: 0.29 ms against 0.49 ms for the fp32 matmul at 1
  row, 0.44 against 1.16 ms at 4 rows, CPU time); its fp32-activation variant is 10-100x
  slower here, so inputs go to bf16 (once per call, not once per expert).
- many rows (prefill, evaluation): the block's weight is dequantized to the activation
  dtype once and multiplied there; the conversion is amortised over the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moebit.moe import MoE
from moebit.moe.experts import Experts
from moebit.moe.kernels import act_new, is_gated

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


_INT8_OK = _has_int8_kernel()


def use_int8_kernel(rows: int, kernel: str) -> bool:
    """Whether a block of ``rows`` rows runs the int8 kernel under ``kernel`` ("auto" rule)."""
    return kernel == "int8" or (kernel == "auto" and rows <= SMALL_ROWS and _INT8_OK)


def int8_linear(x_RK: torch.Tensor, q_NK: torch.Tensor, s_N: torch.Tensor,
                b_N: torch.Tensor | None, kernel: str = "auto",
                s_bf16_N: torch.Tensor | None = None, x_bf16_RK: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """``x @ dequant(q).T (+ b)`` in x's dtype; kernel "int8" (bf16 activations), "dequant" or
    "auto". ``x_bf16_RK``: x already in bfloat16 (a caller converting many blocks at once)."""
    if use_int8_kernel(x_RK.shape[0], kernel):
        s = s_bf16_N if s_bf16_N is not None else s_N
        s = s if s.dtype == torch.bfloat16 else s.to(torch.bfloat16)  # model.to() may cast it
        xb = x_bf16_RK if x_bf16_RK is not None else x_RK.to(torch.bfloat16).contiguous()
        y = torch._weight_int8pack_mm(xb, q_NK, s).to(x_RK.dtype)
    else:
        y = torch.mm(x_RK, q_NK.t().to(x_RK.dtype)).mul_(s_N.to(x_RK.dtype))
    return y if b_N is None else y.add_(b_N.to(x_RK.dtype))


class Int8Experts(nn.Module):
    """The local experts of an ``Experts`` with int8 weights; same ``forward(x_ND, counts)``.

    Any expert type; inference only (no backward). Buffers: ``q_up`` int8 [E, F', d]
    (F' = f, or 2f gate rows first for gated types), ``s_up`` float32 [E, F'], ``q_down``
    int8 [E, d, f], ``s_down`` [E, d]; biases (float32) only where the experts have them.
    """

    def __init__(self, experts: Experts, kernel: str = "auto") -> None:
        super().__init__()
        if kernel not in ("auto", "int8", "dequant"):
            raise ValueError(f"kernel must be auto, int8 or dequant, got {kernel!r}")
        self.num_experts, self.first_expert = experts.num_experts, experts.first_expert
        self.num_local, self.d_model, self.d_ffn = experts.num_local, experts.d_model, experts.d_ffn
        self.expert_type, self.kernel = experts.expert_type, kernel
        w_up, b_up, w_down, b_down = experts.projections()
        if is_gated(self.expert_type):  # stored [E, out, in]: quantize_per_channel takes [E, in, out]
            w_up, w_down = w_up.transpose(1, 2), w_down.transpose(1, 2)
        q_up, s_up = quantize_per_channel(w_up)
        q_down, s_down = quantize_per_channel(w_down)
        for name, t in (("q_up", q_up), ("s_up", s_up), ("q_down", q_down), ("s_down", s_down)):
            self.register_buffer(name, t)
        self.register_buffer("s_up_bf16", s_up.to(torch.bfloat16))
        self.register_buffer("s_down_bf16", s_down.to(torch.bfloat16))
        self.register_buffer("b_up", None if b_up is None else b_up.detach().float().clone())
        self.register_buffer("b_down", None if b_down is None else b_down.detach().float().clone())

    def weight_bytes(self) -> int:
        """Bytes a decode step's kernels can read: int8 weights, float32 scales and biases."""
        ts = (self.q_up, self.s_up, self.q_down, self.s_down, self.b_up, self.b_down)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @torch.no_grad()
    def forward(self, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if len(counts) != self.num_local:
            raise ValueError(f"got {len(counts)} block sizes for {self.num_local} local experts")
        if sum(counts) != x_ND.shape[0]:
            raise ValueError(f"block sizes sum to {sum(counts)} but x has {x_ND.shape[0]} rows")
        out_ND = x_ND.new_empty(x_ND.shape[0], self.d_model)
        # one bf16 copy of the input for every block the int8 kernel takes (not one per expert)
        x_bf16 = (x_ND.to(torch.bfloat16).contiguous()
                  if any(n and use_int8_kernel(n, self.kernel) for n in counts) else None)
        bu, bd = self.b_up, self.b_down
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            r = slice(start, start + n)
            start += n
            xb = x_bf16[r] if x_bf16 is not None else None
            hpre = int8_linear(x_ND[r], self.q_up[e], self.s_up[e], None if bu is None else bu[e],
                               self.kernel, self.s_up_bf16[e], xb)
            h = act_new(self.expert_type, hpre)[0]
            out_ND[r] = int8_linear(h, self.q_down[e], self.s_down[e], None if bd is None else bd[e],
                                    self.kernel, self.s_down_bf16[e])
        return out_ND

    def extra_repr(self) -> str:
        return (f"int8 {self.expert_type} experts {self.first_expert}.."
                f"{self.first_expert + self.num_local - 1} of {self.num_experts}, "
                f"d_model={self.d_model}, d_ffn={self.d_ffn}, kernel={self.kernel}")


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
    """Replace every MoE layer's ``Experts`` by ``Int8Experts`` in place; the rest (attention,
    dense layers, shared experts, routers) stays float. Works on moebit's GPT (every
    expert type) and the Hugging Face decoder alike: both hold ``moebit.moe.MoE`` layers."""

    layers = before = after = 0
    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.experts, Experts):
            ex = m.experts
            before += sum(p.numel() * p.element_size() for p in ex.parameters())
            q = Int8Experts(ex, kernel).to(ex.projections()[0].device)
            m.experts = q
            after += q.weight_bytes()
            layers += 1
    if layers == 0:
        raise ValueError("the model has no MoE layer with float experts to quantize")
    return QuantizeReport(layers, before, after)
