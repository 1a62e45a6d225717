"""The KV cache of one batch being decoded: preallocated keys/values and per-row state.

    cache = model.new_cache(batch=2, max_len=40, starts=[0, 3])   # row 1 left-padded by 3
    out = model(ids_BT, cache=cache, logits_to_keep=1)           # prefill: writes T columns
    out = model(next_B1, cache=cache, logits_to_keep=1)          # one decode step
    cache.finish(0)                                               # row 0 is done

Why preallocated: every block's keys and values live in one [B, H, T_max, Dh] buffer
written in place, where growing by ``torch.cat`` copies the whole past every step.

Why per-row state: prompts of a batch have different lengths, so they are left-padded to
one width. Row b's first ``starts[b]`` columns are padding: its positions count from its
first real column, no query sees a padding key, and the feed-forward runs only on real
tokens of rows still being decoded (``ffn_rows``), so padding and finished rows cost no
expert time and, expert parallel, no all-to-all bytes.

All rows advance together: a forward of T tokens writes columns [filled, filled + T) of
every row. The masks and row indices a step needs are computed once per step (the first
layer that asks) and shared by all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# --kv-cache: the dtypes a model's cache may hold keys and values in (default: its weights')
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def set_kv_dtype(model: torch.nn.Module, name: str | None) -> None:
    """Keys and values of every cache ``model.new_cache`` makes from now on in ``name``
    (``KV_CACHE_DTYPES``; None: the weights' dtype). Why float16: past a few hundred
    positions a decode step reads more cache than weights, and float16 halves it (the
    native step rounds each key and value once, where it writes them, and computes in
    float32; so do the modules, which widen what they read)."""
    if name is not None and name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if name is not None and getattr(model.config, "is_mla", False):
        raise ValueError("--kv-cache: multi-head latent attention caches its compressed "
                         "latent, which keeps the weights' dtype")
    model.kv_dtype = None if name is None else KV_CACHE_DTYPES[name]


def kv_dtype(model: torch.nn.Module, weights: torch.dtype) -> torch.dtype:
    """The dtype ``model``'s caches hold keys and values in (``set_kv_dtype``)."""
    return getattr(model, "kv_dtype", None) or weights


def sdpa(q_BHTd: torch.Tensor, k_BHSd: torch.Tensor, v_BHSd: torch.Tensor,
         mask: torch.Tensor | None, causal: bool, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` with grouped-query heads when the key/value heads
    are fewer than the query heads (GQA); every cache's ``attend`` ends here. Keys and
    values a cache holds in another dtype (``set_kv_dtype``) are widened to the queries'."""
    if k_BHSd.dtype != q_BHTd.dtype:
        k_BHSd, v_BHSd = k_BHSd.to(q_BHTd.dtype), v_BHSd.to(q_BHTd.dtype)
    return F.scaled_dot_product_attention(q_BHTd, k_BHSd, v_BHSd, attn_mask=mask,
                                          is_causal=causal, scale=scale,
                                          enable_gqa=q_BHTd.shape[1] != k_BHSd.shape[1])


@dataclass
class DecodeRows:
    """Where the tokens of a step of one token per row read and write, for a native decode
    step that does the attention itself (``moebit.inference.fused_decode``): token r
    writes column ``col[r]`` of row ``slot[r]`` of ``cache``'s buffers and sees columns
    ``first[r] .. col[r]``, at position ``col[r] - first[r]``; ``live`` (uint8, or None
    for all) marks the tokens whose feed-forward must run."""

    cache: KVCache  # the one holding the [rows, H, T_max, Dh] buffers
    slot: torch.Tensor
    first: torch.Tensor
    col: torch.Tensor
    live: torch.Tensor | None


class KVCache:
    """Per-layer key/value buffers [B, H, T_max, Dh] and each row's padding and liveness."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor],
                 starts: Sequence[int] | None = None) -> None:
        if not k or len(k) != len(v):
            raise ValueError(f"KVCache needs one key and one value buffer per layer, "
                             f"got {len(k)} and {len(v)}")
        b, _, t_max, _ = k[0].shape
        starts = [0] * b if starts is None else [int(s) for s in starts]
        if len(starts) != b:
            raise ValueError(f"KVCache: {len(starts)} row starts for a batch of {b}")
        if any(s < 0 or s >= max(t_max, 1) for s in starts):
            raise ValueError(f"KVCache: row starts {starts} must lie in [0, {t_max})")
        self.k, self.v = k, v
        self.capacity = t_max
        self.starts = starts  # first real column of each row (host copy: no device sync)
        self.start_B = torch.tensor(starts, dtype=torch.long, device=k[0].device)
        self.padded = any(starts)
        self.live = [True] * b  # rows still being decoded (host copy)
        self.filled = 0  # columns written so far, the same for every row
        # this step's mask and feed-forward rows, made by the first layer that asks
        self._mask_at: tuple[int, int] | None = None
        self._mask: torch.Tensor | None = None
        self._rows_at: tuple[int, int] | None = None
        self._rows: torch.Tensor | None = None

    @classmethod
    def allocate(cls, n_layer: int, batch: int, n_head: int, head_dim: int, max_len: int,
                 starts: Sequence[int] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> KVCache:
        shape = (batch, n_head, max_len, head_dim)
        ks = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        vs = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        return cls(ks, vs, starts)

    @property
    def batch(self) -> int:
        return len(self.starts)

    def finish(self, row: int) -> None:
        """Row ``row`` needs no more tokens: its feed-forward stops running."""
        if self.live[row]:
            self.live[row] = False
            self._rows_at = None

    def longest(self, t: int) -> int:
        """Real tokens of the longest live row once ``t`` more columns are written."""
        f = self.filled + t
        return max((f - s for s, alive in zip(self.starts, self.live, strict=True) if alive), default=0)

    def positions(self, t: int, limit: int | None = None) -> torch.Tensor:
        """[B, t] long: the position of each new column in its row (0 on padding), at most
        ``limit`` (a finished row keeps advancing with the others past its last position)."""
        if self.filled + t > self.capacity:
            raise ValueError(f"KVCache holds {self.capacity} columns: {self.filled} are filled, "
                             f"{t} more do not fit")
        cols_T = torch.arange(self.filled, self.filled + t, device=self.start_B.device)
        return (cols_T[None] - self.start_B[:, None]).clamp_(0, limit)

    def update(self, layer: int, k_BHTd: torch.Tensor,
               v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer``'s new keys/values in place; all keys/values so far."""
        f, t = self.filled, k_BHTd.shape[2]
        self.k[layer][:, :, f:f + t] = k_BHTd
        self.v[layer][:, :, f:f + t] = v_BHTd
        return self.k[layer][:, :, :f + t], self.v[layer][:, :, :f + t]

    def attend(self, layer: int, q_BHTd: torch.Tensor, k_BHTd: torch.Tensor,
               v_BHTd: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """The one call a model's attention makes with a cache: write layer ``layer``'s new
        keys/values and return the new queries' attention over every key they may see
        ([B, H, t, Dh]). A cache owns its layout, so it owns the attention too: this one is
        a padded [B, T] batch (``mask_for``); the ragged view of serving
        (``serve.ragged.RaggedView``) packs rows of different lengths instead."""
        t = q_BHTd.shape[2]
        mask = self.mask_for(t)
        keys, values = self.update(layer, k_BHTd, v_BHTd)
        # no mask: one query (sees every key) or nothing cached before (plain causal)
        return sdpa(q_BHTd, keys, values, mask, mask is None and t > 1, scale)

    def advance(self, t: int) -> None:
        """The forward of ``t`` columns is done: the next one writes after them."""
        self.filled += t

    def decode_rows(self, b: int, t: int) -> DecodeRows | None:
        """A step of one token per row of ``b`` rows (``t`` == 1): every row writes column
        ``filled`` and sees its real columns; None for a longer forward."""
        if t != 1 or b != self.batch:
            return None
        if self.filled + 1 > self.capacity:
            self.positions(1)  # raises: the cache is full
        live = None if all(self.live) else torch.tensor(self.live, dtype=torch.uint8)
        return DecodeRows(self, torch.arange(b), self.start_B, torch.full((b,), self.filled),
                          live)

    def mask_for(self, t: int) -> torch.Tensor | None:
        """The attention mask of ``t`` new queries over all keys so far, [B|1, 1, t, S] bool.

        None where the queries need no mask besides plain causality: ``t == 1`` (the query
        is the newest column and sees everything) or nothing filled yet (``is_causal``
        over exactly the t keys). A padding query also sees itself, so no row of the
        softmax is empty (an all-masked row is NaN, and NaN times a zero weight stays NaN).
        """
        if self._mask_at != (self.filled, t):
            self._mask, self._mask_at = self._make_mask(t), (self.filled, t)
        return self._mask

    def ffn_rows(self, t: int) -> torch.Tensor | None:
        """Indices into the step's flattened [B * t] tokens that the feed-forward must run
        on (real tokens of live rows); None when that is every token."""
        if self._rows_at != (self.filled, t):
            self._rows, self._rows_at = self._make_rows(t), (self.filled, t)
        return self._rows

    def _make_mask(self, t: int) -> torch.Tensor | None:
        f = self.filled
        s = f + t
        if not self.padded and (t == 1 or f == 0):
            return None
        dev = self.start_B.device
        key_S = torch.arange(s, device=dev)
        query_T = torch.arange(f, s, device=dev)
        causal_TS = key_S[None, :] <= query_T[:, None]
        if not self.padded:
            return causal_TS[None, None]
        real_BS = key_S[None, :] >= self.start_B[:, None]
        self_TS = key_S[None, :] == query_T[:, None]
        return ((real_BS[:, None, :] & causal_TS[None]) | self_TS[None])[:, None]

    def _make_rows(self, t: int) -> torch.Tensor | None:
        if all(self.live) and self.filled >= max(self.starts, default=0):
            return None
        dev = self.start_B.device
        cols_T = torch.arange(self.filled, self.filled + t, device=dev)
        live_B = torch.tensor(self.live, dtype=torch.bool, device=dev)
        run_BT = (cols_T[None] >= self.start_B[:, None]) & live_B[:, None]
        return run_BT.reshape(-1).nonzero().squeeze(1)
