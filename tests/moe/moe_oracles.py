"""Test-only oracle: each expert as plain autograd ops on exactly the tokens kept for it.

It slices that expert's weights, runs F.linear / F.gelu / F.silu on its tokens and adds the
weighted outputs back per token; src/ never runs experts that way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebit.moe import Routing
from moebit.moe.experts import Experts
from moebit.moe.glu import ClampedSwiGLU


def expert_fn(ex: Experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of ``ex`` on rows x, written out by hand."""
    if ex.expert_type == "gelu_mlp":
        h = x @ ex.w1[e] + (ex.b1[e] if ex.has_bias else 0)
        return F.gelu(h) @ ex.w2[e] + (ex.b2[e] if ex.has_bias else 0)
    f = ex.d_ffn
    b_up, b_down = ex.gate_up_proj_bias, ex.down_proj_bias
    gate = F.linear(x, ex.gate_up_proj[e, :f], None if b_up is None else b_up[e, :f])
    up = F.linear(x, ex.gate_up_proj[e, f:], None if b_up is None else b_up[e, f:])
    if isinstance(ex.act, ClampedSwiGLU):  # transformers' GptOssExperts._apply_gate, spelled out
        a = ex.act
        gate = gate.clamp(min=None, max=a.limit)
        up = up.clamp(min=-a.limit, max=a.limit) if a.limit is not None else up
        return F.linear((up + a.up_shift) * (gate * torch.sigmoid(gate * a.alpha)),
                        ex.down_proj[e], None if b_down is None else b_down[e])
    act = F.silu(gate) if ex.expert_type == "swiglu" else F.gelu(gate)
    return F.linear(act * up, ex.down_proj[e], None if b_down is None else b_down[e])


def expert_oracle(x_SD: torch.Tensor, routing: Routing, ex: Experts) -> torch.Tensor:
    out = torch.zeros_like(x_SD)
    for e in range(ex.num_local):
        tok, choice = ((routing.expert_SK == e) & routing.kept_SK).nonzero(as_tuple=True)
        if tok.numel():
            y = expert_fn(ex, e, x_SD[tok]) * routing.weight_SK[tok, choice].unsqueeze(1)
            out = out.index_add(0, tok, y)
    return out
