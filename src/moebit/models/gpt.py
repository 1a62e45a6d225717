"""A decoder-only byte-level transformer LM whose feed-forward is pluggable.

Pre-norm blocks, causal attention through ``scaled_dot_product_attention``, a GELU MLP,
tied input/output embeddings, vocabulary 256 (raw bytes). Each block's feed-forward is
any module whose ``forward(x_BTD)`` returns an object with ``.hidden`` (same shape) and
``.aux_loss`` (a scalar): the dense MLP here, or an MoE layer from ``moebit.moe``. Dense,
standard MoE and Pyramid-Residual MoE are configurations of this one model.

    model = GPT(GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=256))
    out = model(idx_BT, targets_BT)      # out.logits, out.loss, out.aux_loss
    cache = model.new_cache(batch=B, max_len=T_max)          # decoding: see models.kv_cache
    logits = model(idx_BT, cache=cache, logits_to_keep=1).logits
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebit.models.interface import ModelOutput, keep_columns, keeps_all
from moebit.models.kv_cache import KVCache, kv_dtype
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
    # The settings every MoE block starts from (a dict of MoEConfig keys is accepted); each
    # block takes its own expert count from num_experts. None (or {}) for a dense model.
    moe: MoEConfig | dict[str, Any] | None = None

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
        self.moe = self._moe_settings()

    def _moe_settings(self) -> MoEConfig | None:
        """The MoE blocks' shared MoEConfig, checked against every block's expert count."""
        if not self.num_experts:
            return None
        counts = [self.experts_at(i) for i in self.moe_layers()]
        moe = self.moe if self.moe is not None else {}
        if isinstance(moe, MoEConfig):
            moe = moe.to_dict()
        settings = {k: v for k, v in moe.items() if k != "num_experts"}
        template = MoEConfig.from_dict({**settings, "num_experts": counts[0]})
        for c in counts[1:]:
            template.replace(num_experts=c)  # validates (e.g. divisibility by ep_size)
        return template

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


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; with a ``KVCache``, over every key cached so far.

    Without a cache (training, evaluation) it is one causal ``scaled_dot_product_attention``
    over the T tokens. With one, the new keys/values are written into the cache's buffers
    of this block (``layer``) and the queries attend to all filled columns under the
    cache's padding mask.
    """

    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.layer = layer  # this block's slot in a KVCache
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x_BTD: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).split(D, dim=2)
        shape = (B, T, self.n_head, D // self.n_head)
        q_BHTd, k_BHTd, v_BHTd = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        if cache is None:
            y = F.scaled_dot_product_attention(
                q_BHTd, k_BHTd, v_BHTd, is_causal=True,
                dropout_p=self.dropout if self.training else 0.0,
            )
        else:
            y = cache.attend(self.layer, q_BHTd, k_BHTd, v_BHTd)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


def moe_config_for(cfg: GPTConfig, layer: int) -> Any:
    """The ``moebit.moe.MoEConfig`` of block ``layer`` (its own expert count: Pyramid MoE)."""
    return cfg.moe.replace(num_experts=cfg.experts_at(layer), d_ffn=cfg.moe.d_ffn or cfg.d_ffn)


def build_feed_forward(cfg: GPTConfig, layer: int, ep_groups: Any = None) -> nn.Module:
    """The dense MLP, or an MoE layer (Residual when configured) for ``cfg.moe_layers()``."""
    if cfg.experts_at(layer) == 0:
        return MLP(cfg.d_model, cfg.d_ffn, dropout=cfg.dropout)
    return build_moe(cfg.d_model, moe_config_for(cfg, layer), ep_groups)


def _ffn_infer(ffn: nn.Module, x_SD: torch.Tensor) -> torch.Tensor:
    """A feed-forward's output for inference: its ``infer`` (MoE layers: dropless, no
    losses or statistics), else its forward's hidden state (the dense MLP, custom ones)."""
    infer = getattr(type(ffn), "infer", None)  # on the class: no nn.Module __getattr__ miss
    if infer is not None:
        return infer(ffn, x_SD)
    out = ffn(x_SD)
    return out if isinstance(out, torch.Tensor) else out.hidden


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int, ep_groups: Any = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = build_feed_forward(cfg, layer, ep_groups)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, Any]:
        """(new x, the feed-forward's output); decoding (a cache) returns no output object.

        With a cache the feed-forward runs through ``infer`` on the cache's ``ffn_rows``
        only: padding and finished rows cost no expert time, and with expert parallelism
        an empty step (no rows) still takes part in the all-to-all.
        """
        x = x + self.attn(self.ln1(x), cache)
        if cache is not None:
            return self._decode_ffn(x, cache.ffn_rows(x.shape[1])), None
        out = self.ffn(self.ln2(x))
        if isinstance(out, torch.Tensor):  # the dense MLP: no auxiliary loss
            out = FeedForwardOutput(out, out.new_zeros((), dtype=torch.float32))
        return x + out.hidden, out

    def _decode_ffn(self, x_BTD: torch.Tensor, rows_N: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x_BTD.shape
        h_SD = self.ln2(x_BTD).reshape(b * t, d)
        if rows_N is None:
            return x_BTD + _ffn_infer(self.ffn, h_SD).view(b, t, d).to(x_BTD.dtype)
        out_ND = _ffn_infer(self.ffn, h_SD.index_select(0, rows_N))
        return x_BTD.reshape(b * t, d).index_add(0, rows_N, out_ND.to(x_BTD.dtype)).view(b, t, d)


def gpt_ep_groups(cfg: GPTConfig) -> Any:
    """The expert-parallel process groups a GPT of ``cfg`` uses (a collective call)."""
    assert cfg.moe is not None
    return expert_parallel_groups(cfg.moe.ep_size, hierarchical=cfg.moe.a2a_hierarchical)


class GPT(nn.Module):
    supports_ragged = True  # attention only through cache.attend (models/interface.py)

    def __init__(self, cfg: GPTConfig, ep_groups: Any = None) -> None:
        """``ep_groups``: the expert-parallel groups when ``cfg.moe.ep_size > 1`` (made
        here, collectively, when not given; given when building on the meta device)."""
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        # Expert-parallel process groups, made once (collectively) and shared by all layers.
        self.ep_groups = None
        if cfg.moe is not None and cfg.moe.ep_size > 1:
            self.ep_groups = ep_groups or gpt_ep_groups(cfg)
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
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> ModelOutput:
        """Logits [B, T, V] (the last ``logits_to_keep`` columns when > 0, or the columns a
        1-D index tensor names: ``interface.keep_columns``), the loss when
        ``targets`` are given, the summed auxiliary loss and each block's ffn output.

        ``cache`` (decoding, from ``new_cache``): the T tokens are the next columns of the
        cache's rows; their positions come from the cache (left padding excluded), the
        keys/values are written into it, the MoE layers run their dropless ``infer`` (no
        aux loss, no statistics, ``ffn_outputs`` empty) and the cache advances by T.
        """
        B, T = input_ids.shape
        bs = self.config.block_size
        if cache is None:
            if T > bs:
                raise ValueError(f"sequence of {T} tokens exceeds block_size {bs}")
            pos = torch.arange(T, device=input_ids.device)
            x = self.drop(self.wte(input_ids) + self.wpe(pos))
        else:
            if cache.longest(T) > bs:
                raise ValueError(f"sequence of {cache.longest(T)} tokens exceeds block_size {bs}")
            x = self.wte(input_ids) + self.wpe(cache.positions(T, limit=bs - 1))
        aux = torch.zeros((), device=input_ids.device, dtype=torch.float32)
        ffn_outputs = []
        for block in self.blocks:
            x, ffn_out = block(x, cache)
            if ffn_out is not None:
                aux = aux + ffn_out.aux_loss.float()
                ffn_outputs.append(ffn_out)
        if cache is not None:
            cache.advance(T)
        x = keep_columns(x, logits_to_keep)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            if not keeps_all(logits_to_keep):
                raise ValueError("targets need every column's logits: leave logits_to_keep at 0")
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return ModelOutput(logits, loss, aux, ffn_outputs)

    def new_cache(self, batch: int, max_len: int, starts: Sequence[int] | None = None) -> KVCache:
        """An empty cache for ``batch`` rows of up to ``max_len`` columns, in the model's
        dtype (or ``set_kv_dtype``'s) and device; row b's first ``starts[b]`` columns will
        be left padding."""
        cfg, p = self.config, self.wte.weight
        return KVCache.allocate(cfg.n_layer, batch, cfg.n_head, cfg.d_model // cfg.n_head,
                                max_len, starts, kv_dtype(self, p.dtype), p.device)
