"""The dense feed-forward block, the one MLP class of moebit.

GPT's dense blocks, Residual MoE's dense branch and PR-MoE all use it; it returns a plain
tensor (no auxiliary loss), and callers that need the feed-forward contract wrap it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear(d, f) -> GELU -> Linear(f, d), then dropout (0 by default)."""

    def __init__(self, d_model: int, d_ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ffn)
        self.proj = nn.Linear(d_ffn, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))
