"""Test-only oracle: each expert as plain autograd ops on exactly the tokens kept for it.

It slices that expert's weights, runs F.linear / F.gelu / F.silu on its tokens and adds the
weighted outputs back per token; src/ never runs experts that way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebit.moe import Routing
from moebit.moe.experts import Experts


def expert_fn(ex: Experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of ``ex`` on rows x, written out by hand."""
    if ex.expert_type == "gelu_mlp":
        h = x @ ex.w1[e] + (ex.b1[e] if ex.has_bias else 0)
        return F.gelu(h) @ ex.w2[e] + (ex.b2[e] if ex.has_bias else 0)
    f = ex.d_ffn
    gate = F.linear(x, ex.gate_up_proj[e, :f])
    up = F.linear(x, ex.gate_up_proj[e, f:])
    act = F.silu(gate) if ex.expert_type == "swiglu" else F.gelu(gate)
    return F.linear(act * up, ex.down_proj[e])


def expert_oracle(x_SD: torch.Tensor, routing: Routing, ex: Experts) -> torch.Tensor:
    out = torch.zeros_like(x_SD)
    for e in range(ex.num_local):
        tok, choice = ((routing.expert_SK == e) & routing.kept_SK).nonzero(as_tuple=True)
        if tok.numel():
            y = expert_fn(ex, e, x_SD[tok]) * routing.weight_SK[tok, choice].unsqueeze(1)
            out = out.index_add(0, tok, y)
    return out
