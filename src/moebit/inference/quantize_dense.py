"""Weight-only int8 / int4 dense projections: attention, dense MLPs and the output head.

    report = quantize_dense_(model, bits=8)   # after (or without) quantize_experts_

Why: once the experts are int8 or int4, the float32 attention projections and the head
are most of the bytes a decode step reads (a Mixtral-style model of hidden 1024 with 8
experts: 100 MB of float32 attention against 100 MB of int8 experts per token), so the
step stays far above the bandwidth floor of a model stored at 8 bits throughout, which is
what llama.cpp's Q8_0 files are. Each ``nn.Linear`` outside the MoE layers (their routers
stay float32, as llama.cpp keeps them) becomes a ``QuantLinear`` on the same packed
weights and kernels as the experts (``quantize.quant_linear``: the native GEMV, chosen by
measurement per shape and row count). Embedding lookups read one row a token and stay
float. Inference only.
"""

from __future__ import annotations

import torch
from torch import nn

from moebit.inference import qgemv
from moebit.inference.quantize import QuantizeReport, as_qweight, quant_linear
from moebit.moe import MoE


class QuantLinear(nn.Module):
    """An ``nn.Linear``'s forward on int8 (per output channel) or int4 (per 32 inputs)
    weights; input of any leading shape, output in the input's dtype."""

    def __init__(self, lin: nn.Linear, bits: int = 8, group: int | None = None,
                 kernel: str = "auto") -> None:
        super().__init__()
        group = (0 if bits == 8 else 32) if group is None else group
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.bits, self.group, self.kernel = bits, group, kernel
        qw = qgemv.quantize_weight(lin.weight.detach(), bits, group)
        self.register_buffer("q", qw.q)
        self.register_buffer("s", qw.s.squeeze(-1) if (bits, group) == (8, 0) else qw.s)
        self.register_buffer("bias", None if lin.bias is None else lin.bias.detach().float().clone())
        self._memo: dict = {}  # kernel choices (quant_linear's memo)
        self._qw: tuple = (None, None, None)  # (q, s, their QWeight): rebuilt after .to()

    def weight_bytes(self) -> int:
        ts = (self.q, self.s, self.bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s, qw = self._qw
        if q is not self.q or s is not self.s:  # first call, or .to() made new buffers
            qw = as_qweight(self.q, self.s, self.bits, self.in_features)
            self._qw = (self.q, self.s, qw)
        x_RK = x.reshape(-1, self.in_features)
        y = quant_linear(x_RK, qw, self.bias, self.kernel, memo=self._memo)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"int{self.bits} in={self.in_features} out={self.out_features} "
                f"group={self.group} kernel={self.kernel}")


class DenseQuantizeReport(QuantizeReport):
    """``QuantizeReport`` counting dense projections (``layers``: Linears replaced)."""

    def __str__(self) -> str:
        return (f"int{self.bits} dense projections: {self.layers} linears, weights "
                f"{self.bytes_before / 1e6:.2f} MB -> {self.bytes_after / 1e6:.2f} MB "
                f"({self.ratio:.2f}x smaller)")


def _dense_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, Linear) of every Linear not inside an MoE layer. A module that
    reads a child's ``.weight`` itself (MLA's absorbed decode folds ``kv_b_proj`` into the
    query) names it in ``float_linears``, and it stays float."""
    inside = {id(m) for moe in model.modules() if isinstance(moe, MoE) for m in moe.modules()}
    return [(parent, name, child) for parent in model.modules() if id(parent) not in inside
            for name, child in parent.named_children()
            if isinstance(child, nn.Linear) and id(child) not in inside
            and name not in getattr(parent, "float_linears", ())]


def quantize_dense_(model: nn.Module, bits: int = 8, group: int | None = None,
                    kernel: str = "auto") -> DenseQuantizeReport:
    """Replace every dense ``nn.Linear`` (outside the MoE layers) by a ``QuantLinear``, in
    place; returns the bytes before and after. A head tied to the embedding is quantized
    as the head (a copy); the embedding itself stays float."""
    found = _dense_linears(model)
    if not found:
        raise ValueError("the model has no dense nn.Linear outside its MoE layers to quantize")
    before = after = 0
    for parent, name, lin in found:
        before += sum(p.numel() * p.element_size() for p in lin.parameters())
        q = QuantLinear(lin, bits, group, kernel).to(lin.weight.device)
        setattr(parent, name, q)
        after += q.weight_bytes()
    return DenseQuantizeReport(len(found), before, after, bits)


SCOPES = ("all", "experts")


def quantize_model_(model: nn.Module, bits: int, scope: str = "all") -> list[QuantizeReport]:
    """``--quantize`` of generate and serve, in place: the experts (if the model has any)
    and, under ``scope="all"``, the dense projections too (attention, dense MLPs, head).
    Returns one report per part quantized. A dense model under ``scope="experts"`` is an
    error naming the scope."""
    from moebit.inference.quantize import quantize_experts_

    if scope not in SCOPES:
        raise ValueError(f"--quantize-scope must be one of {SCOPES}, got {scope!r}")
    has_experts = any(isinstance(m, MoE) for m in model.modules())
    if scope == "experts" and not has_experts:
        raise ValueError("--quantize-scope experts: the model is dense (no experts to "
                         "quantize); use --quantize-scope all")
    reports: list[QuantizeReport] = []
    if has_experts:
        reports.append(quantize_experts_(model, bits=bits))
    if scope == "all":
        reports.append(quantize_dense_(model, bits=bits))
    return reports
