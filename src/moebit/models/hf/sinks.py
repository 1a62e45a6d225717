"""gpt-oss attention: a learned per-head sink logit in every softmax, and sliding windows.

A sink is one more logit per head in the softmax's denominator, with no value: the
weights of the real keys then sum to ``1 - p_sink`` (transformers' ``eager_attention_forward``
concatenates it to the scores and drops its column after the softmax). Here it is a key
column of zeros (so its value adds nothing) whose additive mask entry is the head's sink
logit; ``scaled_dot_product_attention`` then computes exactly that softmax, and autograd
carries the gradient into the sinks through the mask. The sink column is never masked, so
no row of the softmax is empty, padding queries included.

A sliding layer lets query position i see keys j with ``i - window < j <= i``
(transformers' ``sliding_window_overlay``). While decoding, the columns before the window
of the step's first query are not read at all; the cache keeps every column (the full
layers need them), so its memory is not windowed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebit.models.kv_cache import KVCache


def _allowed(q_cols_T: torch.Tensor, k_cols_S: torch.Tensor, window: int | None) -> torch.Tensor:
    """[T, S] bool: causal, and inside the window when there is one."""
    diff = q_cols_T[:, None] - k_cols_S[None, :]
    ok = diff >= 0
    return ok & (diff < window) if window else ok


def sink_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks_H: torch.Tensor | None,
              allowed: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """Attention of q [B, H, T, d] over k/v [B, Hkv, S, d] where ``allowed`` [B|1, 1, T, S]
    is True, with one sink logit per head (none: plain masked attention)."""
    gqa = k.shape[1] != q.shape[1]
    if sinks_H is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                              enable_gqa=gqa)
    b, h, t, _ = q.shape
    mb = allowed.shape[0]
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~allowed, float("-inf")).expand(mb, h, t, allowed.shape[-1])
    sink = sinks_H.to(q.dtype).view(1, h, 1, 1).expand(mb, h, t, 1)
    bias = torch.cat((bias, sink), dim=-1)
    zero = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    k, v = torch.cat((k, zero), dim=2), torch.cat((v, zero), dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout,
                                          enable_gqa=gqa)


def cached_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          sinks_H: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``sink_sdpa`` for decoding, written out: the few queries of a step against the cached
    keys, each key/value head's query heads as one matrix (no repeated keys), the sink
    column appended to the scores, not to the cache (which would copy every cached key
    each step)."""
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    q_BKMd = q.reshape(b, hkv, g * t, d)  # query heads of one kv head: rows (head, query)
    scores = torch.matmul(q_BKMd, k.transpose(-1, -2)) * d ** -0.5  # [B, Hkv, G*t, S]
    mask = allowed.expand(allowed.shape[0], 1, t, s).reshape(allowed.shape[0], 1, 1, t, s)
    scores = scores.view(b, hkv, g, t, s).masked_fill(~mask, float("-inf"))
    sink = sinks_H.to(scores.dtype).view(1, hkv, g, 1, 1).expand(b, hkv, g, t, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :s]
    out = torch.matmul(probs.reshape(b, hkv, g * t, s), v)  # [B, Hkv, G*t, d]
    return out.view(b, h, t, d)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       sinks_H: torch.Tensor | None, window: int | None,
                       cache: KVCache | None, layer: int, dropout: float = 0.0) -> torch.Tensor:
    """A gpt-oss layer's attention over this forward's keys, or with ``cache`` over every
    key cached so far (written first), restricted to the window on sliding layers."""
    t = q.shape[2]
    dev = q.device
    if cache is None:
        cols = torch.arange(t, device=dev)
        return sink_sdpa(q, k, v, sinks_H, _allowed(cols, cols, window)[None, None], dropout)
    f = cache.filled
    base = cache.mask_for(t)  # padding and causality (None: plain causal)
    keys, values = cache.update(layer, k, v)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a float16 cache (set_kv_dtype)
    lo = max(0, f - window + 1) if window else 0  # keys before the first query's window
    q_cols = torch.arange(f, f + t, device=dev)
    k_cols = torch.arange(lo, f + t, device=dev)
    allowed = _allowed(q_cols, k_cols, window)[None, None]
    if base is not None:
        allowed = allowed & base[..., lo:]
    if sinks_H is None:
        return sink_sdpa(q, keys[:, :, lo:], values[:, :, lo:], None, allowed)
    return cached_sink_attention(q, keys[:, :, lo:], values[:, :, lo:], sinks_H, allowed)
