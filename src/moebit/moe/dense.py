"""Dense experts: the MLP every token passes through (shared experts, Residual MoE's MLP).

Same expert types as the routed experts, as plain ``nn.Linear`` modules named the way
Hugging Face names them, so a checkpoint's shared expert loads without renaming:

- ``MLP`` (``gelu_mlp``): ``fc`` -> GELU -> ``proj``, biases optional.
- ``GatedMLP`` (``swiglu`` / ``geglu``): ``down_proj(act(gate_proj(x)) * up_proj(x))``,
  no biases (Qwen2-MoE's ``shared_expert``, DeepSeek's ``shared_experts``).

``num_shared_experts`` experts of width f are run as one MLP of width
``num_shared_experts * f`` (as DeepSeek and Megatron-Core do): the sum of n MLPs equals one
MLP holding their hidden units side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """The dense feed-forward block, moebit's one MLP class (GPT's dense blocks use it too):
    Linear(d, f) -> GELU -> Linear(f, d), then dropout (0 by default)."""

    def __init__(self, d_model: int, d_ffn: int, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ffn, bias=bias)
        self.proj = nn.Linear(d_ffn, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with act SiLU (swiglu) or GELU (geglu)."""

    def __init__(self, d_model: int, d_ffn: int, expert_type: str = "swiglu") -> None:
        super().__init__()
        if expert_type not in ("swiglu", "geglu"):
            raise ValueError(f"expert_type must be 'swiglu' or 'geglu', got {expert_type!r}")
        self.expert_type = expert_type
        self.gate_proj = nn.Linear(d_model, d_ffn, bias=False)
        self.up_proj = nn.Linear(d_model, d_ffn, bias=False)
        self.down_proj = nn.Linear(d_ffn, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x)
        g = F.silu(g) if self.expert_type == "swiglu" else F.gelu(g)
        return self.down_proj(g * self.up_proj(x))


def dense_expert(d_model: int, d_ffn: int, expert_type: str, bias: bool) -> nn.Module:
    """A dense MLP of the given expert type (the shared expert's or Residual MoE's MLP)."""
    if expert_type == "gelu_mlp":
        return MLP(d_model, d_ffn, bias=bias)
    if bias:
        raise ValueError(f"expert_bias: {expert_type!r} experts have no biases")
    return GatedMLP(d_model, d_ffn, expert_type)
