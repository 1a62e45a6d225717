"""A decoder-only byte-level transformer LM whose feed-forward is pluggable.

Pre-norm blocks, causal attention through ``scaled_dot_product_attention``, a GELU MLP,
tied input/output embeddings, vocabulary 256 (raw bytes). Each block's feed-forward is
any module whose ``forward(x_BTD)`` returns an object with ``.hidden`` (same shape) and
``.aux_loss`` (a scalar): the dense MLP here, or an MoE layer from ``moebit.moe``. Dense,
standard MoE and Pyramid-Residual MoE are configurations of this one model.

    model = GPT(GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=256))
    out = model(idx_BT, targets_BT)      # out.logits, out.loss, out.aux_loss
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebit.models.interface import ModelOutput
from moebit.moe import MLP, MoEConfig, build_moe, expert_parallel_groups, is_expert_param


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ffn: int = 0  # 0 means 4 * d_model
    dropout: float = 0.0
    # Mixture-of-Experts: 0 is dense; an int puts that many experts in every MoE block; a
    # list gives one count per MoE block (Pyramid MoE: more experts in later layers).
    num_experts: int | list[int] = 0
    moe_every: int = 2  # every moe_every-th block (the last of each group) is an MoE block
    moe: dict[str, Any] = field(default_factory=dict)  # settings for moebit.moe.MoEConfig

    def __post_init__(self) -> None:
        if self.d_ffn == 0:
            self.d_ffn = 4 * self.d_model
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "d_ffn"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model setting {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.moe_every < 1:
            raise ValueError(f"moe_every must be >= 1, got {self.moe_every}")
        n_moe = len(self.moe_layers())
        if isinstance(self.num_experts, list):
            if len(self.num_experts) != n_moe:
                raise ValueError(
                    f"num_experts lists {len(self.num_experts)} counts but the model has "
                    f"{n_moe} MoE blocks (n_layer={self.n_layer}, moe_every={self.moe_every})"
                )
            if any(e < 1 for e in self.num_experts):
                raise ValueError(f"num_experts entries must be >= 1, got {self.num_experts}")
        elif self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def moe_layers(self) -> list[int]:
        """Indices of the blocks whose feed-forward is an MoE layer."""
        if not self.num_experts:
            return []
        return [i for i in range(self.n_layer) if (i + 1) % self.moe_every == 0]

    def experts_at(self, layer: int) -> int:
        layers = self.moe_layers()
        if layer not in layers:
            return 0
        if isinstance(self.num_experts, list):
            return self.num_experts[layers.index(layer)]
        return self.num_experts

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FeedForwardOutput:
    hidden: torch.Tensor
    aux_loss: torch.Tensor


GPTOutput = ModelOutput  # the name older code imports


@dataclass
class KVCache:
    """Keys and values of past positions for one block: [B, H, T_past, Dh]."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x_BTD: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).split(D, dim=2)
        shape = (B, T, self.n_head, D // self.n_head)
        q_BHTd, k_BHTd, v_BHTd = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        past = 0
        if cache is not None:
            past = cache.length
            if cache.k is not None:
                k_BHTd = torch.cat([cache.k, k_BHTd], dim=2)
                v_BHTd = torch.cat([cache.v, v_BHTd], dim=2)
            cache.k, cache.v = k_BHTd, v_BHTd
        if past == 0:
            y = F.scaled_dot_product_attention(
                q_BHTd, k_BHTd, v_BHTd, is_causal=True,
                dropout_p=self.dropout if self.training else 0.0,
            )
        else:
            # New queries sit at positions past..past+T-1 and may see every key up to themselves.
            total = past + T
            mask_TS = torch.ones(T, total, dtype=torch.bool, device=x_BTD.device).tril(past)
            y = F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, attn_mask=mask_TS)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


def moe_config_for(cfg: GPTConfig, layer: int) -> Any:
    """The ``moebit.moe.MoEConfig`` of block ``layer`` (its own expert count: Pyramid MoE)."""
    settings = {**cfg.moe, "num_experts": cfg.experts_at(layer), "d_ffn": cfg.d_ffn}
    return MoEConfig.from_dict(settings)


def build_feed_forward(cfg: GPTConfig, layer: int, ep_groups: Any = None) -> nn.Module:
    """The dense MLP, or an MoE layer (Residual when configured) for ``cfg.moe_layers()``."""
    if cfg.experts_at(layer) == 0:
        return MLP(cfg.d_model, cfg.d_ffn, cfg.dropout)
    return build_moe(cfg.d_model, moe_config_for(cfg, layer), ep_groups)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int, ep_groups: Any = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = build_feed_forward(cfg, layer, ep_groups)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, Any]:
        x = x + self.attn(self.ln1(x), cache)
        out = self.ffn(self.ln2(x))
        if isinstance(out, torch.Tensor):  # the dense MLP: no auxiliary loss
            out = FeedForwardOutput(out, out.new_zeros((), dtype=torch.float32))
        return x + out.hidden, out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        # Expert-parallel process groups, made once (collectively) and shared by all layers.
        self.ep_groups = None
        if cfg.is_moe and int(cfg.moe.get("ep_size", 1)) > 1:
            self.ep_groups = expert_parallel_groups(
                int(cfg.moe["ep_size"]), hierarchical=bool(cfg.moe.get("a2a_hierarchical")))
        self.blocks = nn.ModuleList(Block(cfg, i, self.ep_groups) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        # Residual projections scaled down with depth (GPT-2). Experts initialise themselves.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") and not is_expert_param(p):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters of the whole model, counted once (the tied embedding is one tensor).

        With expert parallelism this rank holds only its share of the experts; the count
        is of the full model, so it is the same on every rank.
        """
        total = 0
        for p in self.parameters():
            n = p.numel()
            if is_expert_param(p) and self.ep_groups is not None:
                n *= self.ep_groups.ep_size
            total += n
        return total

    def num_expert_params(self) -> int:
        scale = self.ep_groups.ep_size if self.ep_groups is not None else 1
        return scale * sum(p.numel() for p in self.parameters()
                           if is_expert_param(p))

    def forward(
        self,
        idx_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
    ) -> ModelOutput:
        B, T = idx_BT.shape
        past = caches[0].length if caches else 0
        if past + T > self.config.block_size:
            raise ValueError(
                f"sequence of {past + T} tokens exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(past, past + T, device=idx_BT.device)
        x = self.drop(self.wte(idx_BT) + self.wpe(pos))
        aux = torch.zeros((), device=idx_BT.device, dtype=torch.float32)
        ffn_outputs = []
        for i, block in enumerate(self.blocks):
            x, ffn_out = block(x, caches[i] if caches else None)
            aux = aux + ffn_out.aux_loss.float()
            ffn_outputs.append(ffn_out)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets_BT.reshape(-1))
        return ModelOutput(logits, loss, aux, ffn_outputs)

    def new_caches(self) -> list[KVCache]:
        return [KVCache() for _ in self.blocks]
