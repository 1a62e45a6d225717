"""Multi-head latent attention (MLA) of DeepSeek-V2 / V3, in two forms over the same weights.

Each token's keys and values come from one compressed latent: ``kv_a_proj_with_mqa``
maps x to ``c`` (``kv_lora_rank`` wide, RMSNormed) and to one rotary key ``k_pe``
(``qk_rope_head_dim`` wide, shared by all heads); ``kv_b_proj`` expands ``c`` into every
head's non-rotary key (``qk_nope_head_dim``) and value (``v_head_dim``). Queries come
from ``q_proj``, or from ``q_a_proj`` -> RMSNorm -> ``q_b_proj`` when ``q_lora_rank`` is
set, split into a non-rotary and a rotary part the same way.

- The plain form (training, a forward without a cache, and a long prefill chunk):
  expand ``c`` into keys and values and run ordinary attention, as transformers does.
- The absorbed form (decode steps, short chunks): the cache holds only ``[c, k_pe]`` per
  token (``kv_lora_rank + qk_rope_head_dim`` numbers per layer instead of
  ``heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)``), and the expansion is
  folded into the query and the output instead of applied to every cached token:
  ``q_nope . (W_uk c) = (W_uk^T q_nope) . c`` and ``sum_s p_s W_uv c_s = W_uv sum_s p_s c_s``.
  Every head then attends over the same single-head latent keys ``[c, k_pe]`` with the
  latent ``c`` as its values: one attention of ``heads * t`` queries over the cache,
  with no per-head key or value ever built. Per step this costs the cache length times
  ``2 kv_lora_rank + qk_rope_head_dim`` per head, against ``kv_lora_rank * (qk_nope +
  v_head_dim)`` per cached token for re-expanding it, so decoding at long context no
  longer pays for the expansion (``_absorbs``: the form is picked by that cost).

RoPE: DeepSeek rotates its rotary dimensions as interleaved pairs (``rope_interleave``,
always on V2): q and k are rotated pair by pair and laid out evens-then-odds, as
transformers' V3 does; V2's complex-number layout is the same numbers in another order of
dimensions, the same for q and k, so every score is the same. With yarn RoPE the softmax
scale is ``qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2``.

The cache is a plain ``KVCache`` (or the server's ``SlotKVCache``) whose key and value
buffers of a layer are one tensor, ``[B, 1, T_max, kv_lora_rank + qk_rope_head_dim]``:
the model's ``update`` writes the latent once per slot, and every cache that drives a
model (row starts, masks, slots) works unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebit.models.hf.norm import RMSNorm
from moebit.models.kv_cache import KVCache


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: Any) -> float:
    """transformers' ``yarn_apply_mscale``: qk_head_dim ** -0.5, times mscale ** 2 when a
    scaled RoPE gives ``mscale_all_dim``."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    all_dim = cfg.rope_params.get("mscale_all_dim")
    if cfg.rope_type != "default" and all_dim:
        scale *= _yarn_mscale(cfg.rope_factor, all_dim) ** 2
    return scale


def rope_pairs(x_BHTr: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """Rotate the rotary part of q or k: interleaved pairs (DeepSeek) or halves."""
    cos, sin = cos_BTr[:, None].to(x_BHTr.dtype), sin_BTr[:, None].to(x_BHTr.dtype)
    if not interleave:
        x1, x2 = x_BHTr.chunk(2, dim=-1)
        return x_BHTr * cos + torch.cat((-x2, x1), dim=-1) * sin
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x_BHTr[..., 0::2], x_BHTr[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def latent_cache(cfg: Any, batch: int, max_len: int, starts: Sequence[int] | None,
                 dtype: torch.dtype, device: torch.device | str) -> KVCache:
    """A ``KVCache`` of one latent buffer per layer, [B, 1, T_max, kv_lora_rank + rope],
    passed as both its key and its value buffer (held once)."""
    shape = (batch, 1, max_len, cfg.kv_lora_rank + cfg.head_dim)
    bufs = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    return KVCache(bufs, bufs, starts)


def cache_bytes_per_token(cache: KVCache) -> int:
    """Bytes the cache holds per token of one row, all layers (shared buffers once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in list(cache.k) + list(cache.v):
        seen.setdefault(t.data_ptr(), t)
    total = sum(t.numel() * t.element_size() for t in seen.values())
    return total // max(cache.batch * cache.capacity, 1)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention; parameter names are transformers'."""

    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        d, h = cfg.hidden_size, cfg.num_heads
        self.nope, self.rope, self.r, self.dv = (cfg.qk_nope_head_dim, cfg.head_dim,
                                                 cfg.kv_lora_rank, cfg.v_head_dim)
        qk = self.nope + self.rope
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.r + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = nn.Linear(self.r, h * (self.nope + self.dv), bias=False)
        self.float_linears = ("kv_b_proj",)  # the absorbed decode reads its weight
        self.o_proj = nn.Linear(h * self.dv, d, bias=bias)
        self.scale = softmax_scale(cfg)

    def _query(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        return q.view(b, t, self.cfg.num_heads, self.nope + self.rope).transpose(1, 2)

    def _latent(self, x_BTD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """[c, rotated k_pe] of the new tokens, [B, 1, T, kv_lora_rank + rope]."""
        c, k_pe = self.kv_a_proj_with_mqa(x_BTD).split([self.r, self.rope], dim=-1)
        k_pe = rope_pairs(k_pe[:, None], *cos_sin, self.cfg.rope_interleave)
        return torch.cat((self.kv_a_layernorm(c)[:, None], k_pe), dim=-1)

    def forward(self, x_BTD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q_nope, q_pe = self._query(x_BTD).split([self.nope, self.rope], dim=-1)
        q_pe = rope_pairs(q_pe, *cos_sin, self.cfg.rope_interleave)
        latent = self._latent(x_BTD, cos_sin)
        if cache is None:
            drop = self.cfg.attention_dropout if self.training else 0.0
            y = self._plain(q_nope, q_pe, latent, None, t > 1, drop)
        else:
            mask = cache.mask_for(t)
            every, _ = cache.update(self.layer, latent, latent)
            if self._absorbs(t):
                y = self._absorbed(q_nope, q_pe, every, mask)
            else:
                y = self._plain(q_nope, q_pe, every, mask, mask is None and t > 1, 0.0)
        # heads x v_head_dim named, not inferred: a rank may run a zero-row batch
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.cfg.num_heads * self.dv))

    def _absorbs(self, t: int) -> bool:
        """The absorbed form costs t * (2 r + rope) per head and cached token, the plain
        one r * (nope + v) for expanding it plus t * (nope + rope + v) for attending."""
        return t * (2 * self.r + self.rope) < self.r * (self.nope + self.dv) + t * (
            self.nope + self.rope + self.dv)

    def _plain(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_B1SL: torch.Tensor,
               mask: torch.Tensor | None, causal: bool, drop: float) -> torch.Tensor:
        """Expand the latents into every head's keys and values; ordinary attention."""
        b, h, s = q_nope.shape[0], self.cfg.num_heads, latent_B1SL.shape[2]
        c, k_pe = latent_B1SL[:, 0].split([self.r, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(b, s, h, self.nope + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(b, h, s, self.rope)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              dropout_p=drop, scale=self.scale)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_B1SL: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Fold W_uk into the query and W_uv into the output; attend over the latents."""
        b, h, t, _ = q_nope.shape
        s = latent_B1SL.shape[2]
        w = self.kv_b_proj.weight.view(h, self.nope + self.dv, self.r)
        q_lat = torch.matmul(q_nope, w[:, :self.nope])  # [B, H, T, r]
        q = torch.cat((q_lat, q_pe), dim=-1).reshape(b, 1, h * t, self.r + self.rope)
        if mask is None and t > 1:  # plain causality over exactly these t keys
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)[None, None]
        if mask is not None:  # the same [T, S] mask for every head: queries are (head, t)
            mask = mask.expand(mask.shape[0], 1, t, s)[:, :, None].expand(
                mask.shape[0], 1, h, t, s).reshape(mask.shape[0], 1, h * t, s)
        # values = the whole latent (no strided copy of its first r columns), sliced after
        y = F.scaled_dot_product_attention(q, latent_B1SL, latent_B1SL, attn_mask=mask,
                                           scale=self.scale)[..., :self.r]
        y_lat = y.reshape(b, h, t, self.r)
        return torch.matmul(y_lat, w[:, self.nope:].transpose(1, 2))  # [B, H, T, v]
