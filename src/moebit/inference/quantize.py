"""Weight-only int8 / int4 experts: symmetric scales per output channel or per group.

    report = quantize_experts_(model)                 # int8, one scale per output channel
    report = quantize_experts_(model, bits=4)         # int4, one scale per 32 weights
    print(report)                                     # expert weight bytes before / after

Why experts only: in an MoE model they are almost all of the parameters (64 experts of a
[d, 4d] MLP per MoE layer against one attention block), and at decoding time a step reads
the weights of the experts its few tokens chose: the step is bound by weight bytes, which
int8 cuts 4x and int4 about 7x. int8 scales are per output channel (one per column of
``x @ w``), so one large weight only coarsens its own channel: |w - q*s| <= s/2 with
s = max|w[:, j]| / 127. int4 (q in [-7, 7]) needs finer scales to stay useful: one per
``group`` (default 32) consecutive inputs of each channel, s = max|w[group]| / 7.

Every expert type is covered: ``gelu_mlp`` (with or without biases) and the gated
``swiglu`` / ``geglu`` experts (Mixtral, Qwen-MoE, OLMoE: the Hugging Face decoder's), whose
fused ``gate_up_proj`` [E, 2f, d] is quantized per row (each row is one output channel of
the gate or the up projection) and ``down_proj`` [E, d, f] likewise. The activation runs
in the activation dtype on the dequantized products, so the error of a whole expert is
the two linears' bounds carried through the activation (docs/inference.md states both;
``tests/test_quantize_experts.py`` checks them).

Kernels per expert block (``kernel``):
- "native": ``moebit.inference.qgemv``'s C kernels (int8 and int4, float32 activations,
  reading only the packed bytes); built at first use for the CPU's ISA level.
- "int8": ``torch._weight_int8pack_mm`` with bf16 activations (int8 per channel only).
- "dequant": the block's weight dequantized to the activation dtype, then one matmul.
- "auto" (default): whichever candidate ran fastest for this (bits, group, shape, dtype,
  threads, rows rounded up to a power of two) on this machine (``moebit.moe.autotune``:
  measured on first use, cached on disk). With ``MOEBIT_AUTOTUNE=0`` auto takes "native"
  where it builds; without the native build (no gcc, ``MOEBIT_NATIVE=0``; one warning)
  it keeps the earlier rule: "int8" for at most ``SMALL_ROWS`` rows, else "dequant".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moebit.inference import qgemv
from moebit.inference.qgemv import QWeight
from moebit.moe import MoE, autotune
from moebit.moe.experts import Experts
from moebit.moe.kernels import act_new, is_gated

KERNELS = ("auto", "native", "int8", "dequant")
# Without the native build only: auto's int8-kernel limit (measured on one 2-core host)
SMALL_ROWS = 16


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


def as_qweight(q: torch.Tensor, s: torch.Tensor, bits: int, k: int) -> QWeight:
    """One expert's packed weight: s [N] (int8 per channel) or [N, groups]."""
    s2 = s if s.dim() == 2 else s[:, None]
    kp = q.shape[-1] * (2 if bits == 4 else 1)
    return QWeight(q, s2, bits, k, kp // s2.shape[-1])


def _per_channel_int8(qw: QWeight) -> bool:
    return qw.bits == 8 and qw.s.shape[-1] == 1


def candidates(qw: QWeight) -> list[str]:
    """The kernels that can run ``qw`` here: native (if built), int8 (int8 per channel)."""
    out = ["native"] if qgemv.native_available() else []
    if _per_channel_int8(qw) and _INT8_OK:
        out.append("int8")
    return [*out, "dequant"]


def _untuned(qw: QWeight, rows: int) -> str:
    if qgemv.native_available():
        return "native"
    qgemv._fallback_warning()
    return "int8" if _per_channel_int8(qw) and _INT8_OK and rows <= SMALL_ROWS else "dequant"


def tune_key(qw: QWeight, rows: int, dtype: torch.dtype) -> str:
    """The problem a choice is remembered for ("stream": measured on weights streamed
    from memory, ``streamed_copies``)."""
    return (f"qgemm|stream|int{qw.bits}|group={qw.group}|N={qw.n}|K={qw.k}|"
            f"{str(dtype).removeprefix('torch.')}|threads={torch.get_num_threads()}|"
            f"rows={autotune.rows_bucket(rows)}")


STREAM_BYTES = 96 << 20  # the weights one timing pass reads: several times any L3 here
# Blocks of up to this many rows (decode steps: the 1-16) are timed streaming:
# their kernels are bound by reading weights. More rows reuse each weight row from cache.
DECODE_ROWS = 16


def streamed_copies(qw: QWeight, total: int = STREAM_BYTES) -> list[QWeight]:
    """``qw`` and copies of it, ``total`` bytes in all (at least one), for timing kernels
    as a decode step runs them: each weight read once, from memory. Timed again and again
    on one weight, which then sits in the cache, the candidates rank otherwise (measured:
    ``torch._weight_int8pack_mm`` level with the native GEMV on a hot 4 MB weight, half its
    speed when streaming)."""
    size = qw.q.numel() * qw.q.element_size() + qw.s.numel() * qw.s.element_size()
    n = max(1, min(256, total // max(1, size)))
    return [qw] + [QWeight(qw.q.clone(), qw.s.clone(), qw.bits, qw.k, qw.group)
                   for _ in range(n - 1)]


def pick_kernel(qw: QWeight, rows: int, kernel: str = "auto",
                dtype: torch.dtype = torch.float32) -> str | None:
    """The kernel for a block of ``rows`` rows; None where auto has yet to measure."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "int8" and not _per_channel_int8(qw):
        raise ValueError("kernel 'int8' (torch._weight_int8pack_mm) needs int8 weights with "
                         "one scale per output channel (bits=8, group=0)")
    if kernel != "auto":
        return kernel
    if not autotune.enabled():
        return _untuned(qw, rows)
    cands = candidates(qw)
    hit = autotune.cached(tune_key(qw, rows, dtype))
    return hit.choice if hit is not None and hit.choice in cands else None


def use_int8_kernel(rows: int, kernel: str, qw: QWeight | None = None) -> bool:
    """Whether a block of ``rows`` rows runs ``torch._weight_int8pack_mm`` (bf16
    activations) under ``kernel``; ``qw``: the weight (default: some int8 per channel)."""
    if qw is None:
        qw = QWeight(torch.zeros(1, 1, dtype=torch.int8), torch.ones(1, 1), 8, 1, 1)
    return kernel == "int8" or (kernel == "auto" and pick_kernel(qw, rows) == "int8")


def _run(choice: str, x_RK: torch.Tensor, qw: QWeight, s_bf16_N: torch.Tensor | None,
         x_bf16_RK: torch.Tensor | None) -> torch.Tensor:
    if choice == "int8":
        s = s_bf16_N if s_bf16_N is not None else qw.s[:, 0]
        s = s if s.dtype == torch.bfloat16 else s.to(torch.bfloat16)  # model.to() may cast it
        xb = x_bf16_RK if x_bf16_RK is not None else x_RK.to(torch.bfloat16).contiguous()
        return torch._weight_int8pack_mm(xb, qw.q, s).to(x_RK.dtype)
    if choice == "native":
        return qgemv.qgemm(x_RK, qw).to(x_RK.dtype)
    if _per_channel_int8(qw):
        return torch.mm(x_RK, qw.q.t().to(x_RK.dtype)).mul_(qw.s[:, 0].to(x_RK.dtype))
    return torch.mm(x_RK, qgemv.dequantize_weight(qw).t().to(x_RK.dtype))


Memo = dict  # (kernel, rows bucket, dtype, threads) -> choice: a module's, looked up first


def quant_linear(x_RK: torch.Tensor, qw: QWeight, b_N: torch.Tensor | None,
                 kernel: str = "auto", s_bf16_N: torch.Tensor | None = None,
                 x_bf16_RK: torch.Tensor | None = None, memo: Memo | None = None,
                 ) -> torch.Tensor:
    """``x @ dequant(qw).T (+ b)`` in x's dtype on ``kernel`` (module docstring);
    ``x_bf16_RK``: x already in bfloat16 (a caller converting many blocks at once);
    ``memo``: the calling module's choices for this weight's shape (a decode step makes
    dozens of these calls, and the full lookup costs about three times the native call)."""
    rows = x_RK.shape[0]
    key = (kernel, autotune.rows_bucket(rows), x_RK.dtype, torch.get_num_threads())
    choice = memo.get(key) if memo is not None else None
    if choice is None:
        choice = _choose(x_RK, qw, kernel, s_bf16_N, x_bf16_RK)
        if memo is not None:
            memo[key] = choice
    y = _run(choice, x_RK, qw, s_bf16_N, x_bf16_RK)
    return y if b_N is None else y.add_(b_N.to(x_RK.dtype))


def _choose(x_RK: torch.Tensor, qw: QWeight, kernel: str, s_bf16_N: torch.Tensor | None,
            x_bf16_RK: torch.Tensor | None) -> str:
    rows = x_RK.shape[0]
    choice = pick_kernel(qw, rows, kernel, x_RK.dtype)
    if choice is None:  # auto, first block of this kind: time every candidate on it
        copies = streamed_copies(qw) if rows <= DECODE_ROWS else [qw]
        runs = {c: (lambda c=c: [_run(c, x_RK, w, s_bf16_N, x_bf16_RK) for w in copies])
                for c in candidates(qw)}
        choice = autotune.choose(tune_key(qw, rows, x_RK.dtype), runs,
                                 default=_untuned(qw, rows)).choice
    return choice


def int8_linear(x_RK: torch.Tensor, q_NK: torch.Tensor, s_N: torch.Tensor,
                b_N: torch.Tensor | None, kernel: str = "auto",
                s_bf16_N: torch.Tensor | None = None, x_bf16_RK: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """``quant_linear`` for int8 weights [N, K] with one scale per output channel [N]."""
    return quant_linear(x_RK, as_qweight(q_NK, s_N, 8, q_NK.shape[1]), b_N, kernel,
                        s_bf16_N, x_bf16_RK)


class QuantExperts(nn.Module):
    """The local experts of an ``Experts`` with int8 or int4 weights; same
    ``forward(x_ND, counts)``. Any expert type; inference only (no backward).

    Buffers: ``q_up`` [E, F', d] (F' = f, or 2f gate rows first for gated types) and
    ``q_down`` [E, d, f]: int8, or for int4 uint8 with two weights a byte (last dim
    padded to whole groups, halved; layout in ``moebit.inference._qgemv_c``); scales
    ``s_up`` / ``s_down`` float32, [E, N] per channel (int8 default) or [E, N, groups];
    biases (float32) only where the experts have them.
    """

    def __init__(self, experts: Experts, kernel: str = "auto", bits: int = 8,
                 group: int | None = None) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        group = (0 if bits == 8 else 32) if group is None else group
        if kernel == "int8" and (bits, group) != (8, 0):
            raise ValueError("kernel 'int8' needs bits=8 with per-channel scales (group=0)")
        self.num_experts, self.first_expert = experts.num_experts, experts.first_expert
        self.num_local, self.d_model, self.d_ffn = experts.num_local, experts.d_model, experts.d_ffn
        self.expert_type, self.kernel, self.bits, self.group = experts.expert_type, kernel, bits, group
        self.act = experts.act  # the type, or gpt-oss's clamped SwiGLU
        w_up, b_up, w_down, b_down = experts.projections()
        if not is_gated(self.expert_type):  # stored [E, in, out]: quantize_weight takes [E, out, in]
            w_up, w_down = w_up.transpose(1, 2), w_down.transpose(1, 2)
        for name, w in (("up", w_up), ("down", w_down)):
            qw = qgemv.quantize_weight(w, bits, group)
            s = qw.s.squeeze(-1) if group == 0 and bits == 8 else qw.s
            self.register_buffer(f"q_{name}", qw.q)
            self.register_buffer(f"s_{name}", s)
            if bits == 8 and group == 0:
                self.register_buffer(f"s_{name}_bf16", s.to(torch.bfloat16))
            else:
                self.register_buffer(f"s_{name}_bf16", None)
        self.register_buffer("b_up", None if b_up is None else b_up.detach().float().clone())
        self.register_buffer("b_down", None if b_down is None else b_down.detach().float().clone())
        # kernel choices (quant_linear's memo): every expert of a projection has its shape
        self._memo: dict[str, Memo] = {"up": {}, "down": {}}
        self._qws: dict[str, tuple] = {}  # which -> (q, s, one QWeight per expert)

    def weight(self, which: str, e: int) -> QWeight:
        """Expert e's "up" or "down" weight as a ``QWeight`` (made once per buffer: a
        decode step asks for a few experts' weights in every layer)."""
        q, s = getattr(self, f"q_{which}"), getattr(self, f"s_{which}")
        held = self._qws.get(which)
        if held is None or held[0] is not q or held[1] is not s:  # first use, or .to()
            k = self.d_model if which == "up" else self.d_ffn
            held = (q, s, [as_qweight(q[i], s[i], self.bits, k) for i in range(q.shape[0])])
            self._qws[which] = held
        return held[2][e]

    def weight_bytes(self) -> int:
        """Bytes a decode step's kernels can read: packed weights, float32 scales, biases."""
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
                  if any(n and self._takes_int8(e, n, x_ND.dtype) for e, n in enumerate(counts))
                  else None)
        bu, bd, su, sd = self.b_up, self.b_down, self.s_up_bf16, self.s_down_bf16
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            r = slice(start, start + n)
            start += n
            xb = x_bf16[r] if x_bf16 is not None else None
            hpre = quant_linear(x_ND[r], self.weight("up", e), None if bu is None else bu[e],
                                self.kernel, None if su is None else su[e], xb,
                                self._memo["up"])
            h = act_new(self.act, hpre)[0]
            out_ND[r] = quant_linear(h, self.weight("down", e), None if bd is None else bd[e],
                                     self.kernel, None if sd is None else sd[e],
                                     memo=self._memo["down"])
        return out_ND

    def _takes_int8(self, e: int, rows: int, dtype: torch.dtype) -> bool:
        return self.s_up_bf16 is not None and pick_kernel(
            self.weight("up", e), rows, self.kernel, dtype) == "int8"

    def extra_repr(self) -> str:
        return (f"int{self.bits} {self.expert_type} experts {self.first_expert}.."
                f"{self.first_expert + self.num_local - 1} of {self.num_experts}, "
                f"d_model={self.d_model}, d_ffn={self.d_ffn}, group={self.group}, "
                f"kernel={self.kernel}")


Int8Experts = QuantExperts  # the name before int4: bits=8 is the default


@dataclass
class QuantizeReport:
    layers: int  # MoE layers quantized
    bytes_before: int  # this rank's expert weights and biases before
    bytes_after: int  # packed weights + float32 scales and biases
    bits: int = 8

    @property
    def ratio(self) -> float:
        return self.bytes_before / max(1, self.bytes_after)

    def __str__(self) -> str:
        return (f"int{self.bits} experts: {self.layers} MoE layers, expert weights "
                f"{self.bytes_before / 1e6:.2f} MB -> {self.bytes_after / 1e6:.2f} MB "
                f"({self.ratio:.2f}x smaller)")


def quantize_experts_(model: nn.Module, kernel: str = "auto", bits: int = 8,
                      group: int | None = None) -> QuantizeReport:
    """Replace every MoE layer's ``Experts`` by ``QuantExperts`` (``bits`` 8 or 4; ``group``
    default: per channel for int8, 32 for int4) in place; the rest (attention, dense
    layers, shared experts, routers) stays float. Works on moebit's GPT (every expert
    type) and the Hugging Face decoder alike: both hold ``moebit.moe.MoE`` layers."""

    layers = before = after = 0
    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.experts, Experts):
            ex = m.experts
            before += sum(p.numel() * p.element_size() for p in ex.parameters())
            q = QuantExperts(ex, kernel, bits, group).to(ex.projections()[0].device)
            m.experts = q
            after += q.weight_bytes()
            layers += 1
    if layers == 0:
        raise ValueError("the model has no MoE layer with float experts to quantize")
    return QuantizeReport(layers, before, after, bits)
