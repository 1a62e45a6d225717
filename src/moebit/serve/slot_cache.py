"""A KV cache of fixed slots, each with its own length: the cache of continuous batching.

    cache = SlotKVCache.for_model(model, slots=8, scratch=64)
    cache.bind([3, 5])                    # this forward's rows: slots 3 and 5
    model(next_21, cache=cache, logits_to_keep=1)   # one decode step of two slots
    cache.bind([2], n_real=[40]); model(chunk_1T, cache=cache)   # a prefill chunk
    cache.reset(3)                        # slot 3's request left: the slot is free

Why not ``models.kv_cache.KVCache``: there every row advances together (one ``filled``
for the batch), which suits a batch that starts and ends together. Here requests join
and leave at any step, so each slot keeps its own length, and a forward runs on any
subset of slots (``bind``). It keeps ``KVCache``'s interface to the model (positions,
update, mask_for, ffn_rows, longest, advance), so the model's own forward drives it.

Prefill chunks of several slots go in one forward right-padded to the longest chunk:
the padding columns are written past a slot's real length (into ``scratch`` spare
columns at the end, never read by a real query, overwritten by the slot's next tokens),
and the feed-forward skips them (``ffn_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moebit.models.interface import CausalLM
from moebit.models.kv_cache import DecodeRows, KVCache


class SlotKVCache(KVCache):
    """Buffers [slots, H, block_size + scratch, Dh] per layer; a length per slot."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], block_size: int) -> None:
        super().__init__(k, v)
        self.block_size = block_size
        self.lengths = [0] * k[0].shape[0]  # tokens cached in each slot (host copy)
        self.bind([])

    @classmethod
    def for_model(cls, model: CausalLM, slots: int, scratch: int) -> SlotKVCache:
        """Slots shaped by the model's own ``new_cache`` (heads, head size, dtype, device:
        moebit's GPT and the Hugging Face decoders alike), ``block_size + scratch`` long."""
        block = model.config.block_size
        base = model.new_cache(slots, block + scratch)
        # zeros, not empty: a masked key still multiplies its value by weight 0 (NaN * 0 = NaN)
        return cls([k.zero_() for k in base.k], [v.zero_() for v in base.v], block)

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def reset(self, slot: int) -> None:
        """The slot is free: its next request starts at column 0 (old keys are never read)."""
        self.lengths[slot] = 0

    def bind(self, rows: Sequence[int], n_real: Sequence[int] | None = None) -> None:
        """The next forward runs on these slots, in this order; ``n_real[i]`` of its T
        columns are real for row i (the rest right padding); default: all of them."""
        self.rows = list(rows)
        self.n_real = None if n_real is None else [int(n) for n in n_real]
        dev = self.k[0].device
        self.rows_R = torch.tensor(self.rows, dtype=torch.long, device=dev)
        self.len_R = torch.tensor([self.lengths[r] for r in self.rows], dtype=torch.long, device=dev)
        self._contiguous = self.rows == list(range(len(self.rows)))
        self._base = max((self.lengths[r] for r in self.rows), default=0)  # longest row so far
        # made once per forward, by the first layer that asks, and shared by all layers
        self._mask_at = None
        self._rows_at = None
        self._index_at: int | None = None

    def longest(self, t: int) -> int:
        real = self.n_real or [t] * len(self.rows)
        return max((self.lengths[r] + n for r, n in zip(self.rows, real, strict=True)), default=0)

    def positions(self, t: int, limit: int | None = None) -> torch.Tensor:
        if self._base + t > self.capacity:
            raise ValueError(f"SlotKVCache holds {self.capacity} columns per slot: "
                             f"{t} more do not fit")
        cols_T = torch.arange(t, device=self.len_R.device)
        return (self.len_R[:, None] + cols_T[None]).clamp_(0, limit)

    def _cols(self, t: int) -> torch.Tensor:
        return self.len_R[:, None] + torch.arange(t, device=self.len_R.device)[None]

    def _flat_index(self, t: int) -> torch.Tensor:
        """Where this forward's [R, H, t] new columns go in a buffer viewed as [-1, Dh]."""
        if self._index_at != t:
            _, h, c, _ = self.k[0].shape
            heads_H = torch.arange(h, device=self.len_R.device)
            row_RH = self.rows_R[:, None] * h + heads_H[None]
            self._index = (row_RH[:, :, None] * c + self._cols(t)[:, None, :]).reshape(-1)
            self._index_at = t
        return self._index

    def update(self, layer: int, k_BHTd: torch.Tensor,
               v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, dh = k_BHTd.shape[2], k_BHTd.shape[3]
        s = self._base + t
        # one index_copy_ into the flat buffer: cheaper than an advanced-index assignment
        index = self._flat_index(t)
        kb, vb = self.k[layer], self.v[layer]
        kb.view(-1, dh).index_copy_(0, index, k_BHTd.reshape(-1, dh).to(kb.dtype))
        vb.view(-1, dh).index_copy_(0, index, v_BHTd.reshape(-1, dh).to(vb.dtype))
        if self._contiguous:
            r = len(self.rows)
            return self.k[layer][:r, :, :s], self.v[layer][:r, :, :s]
        # slice first: the gathered copy holds the s columns in use, not the whole capacity
        return (self.k[layer][:, :, :s].index_select(0, self.rows_R),
                self.v[layer][:, :, :s].index_select(0, self.rows_R))

    def mask_for(self, t: int) -> torch.Tensor | None:
        """[R, 1, t, S] bool: query i of row r sees keys 0 .. lengths[r] + i (its own past
        and itself); None for one query per row when every row has the same length."""
        if self._mask_at != (0, t):
            self._mask, self._mask_at = self._make_mask(t), (0, t)
        return self._mask

    def _make_mask(self, t: int) -> torch.Tensor | None:
        lens = [self.lengths[r] for r in self.rows]
        if t == 1 and len(set(lens)) <= 1:
            return None
        s = self._base + t
        key_S = torch.arange(s, device=self.len_R.device)
        return (key_S[None, None, :] <= self._cols(t)[:, :, None])[:, None]

    def ffn_rows(self, t: int) -> torch.Tensor | None:
        """Indices of the real tokens of the flattened [R * t]; None when all are real."""
        if self._rows_at != (0, t):
            self._rows, self._rows_at = self._make_rows(t), (0, t)
        return self._rows

    def _make_rows(self, t: int) -> torch.Tensor | None:
        if self.n_real is None or all(n == t for n in self.n_real):
            return None
        real_RT = torch.arange(t)[None] < torch.tensor(self.n_real)[:, None]
        return real_RT.reshape(-1).nonzero().squeeze(1).to(self.len_R.device)

    def decode_rows(self, b: int, t: int) -> DecodeRows | None:
        """One token per bound slot, at its own length; a slot with no real token rides
        along (its feed-forward skipped, its column written and later overwritten)."""
        if t != 1 or not self.rows or b != len(self.rows):
            return None
        if self._base + 1 > self.capacity:
            self.positions(1)  # raises: a slot is full
        live = None if self.n_real is None else torch.tensor(self.n_real, dtype=torch.uint8)
        return DecodeRows(self, self.rows_R, torch.zeros_like(self.len_R), self.len_R, live)

    def advance(self, t: int) -> None:
        real = self.n_real or [t] * len(self.rows)
        for r, n in zip(self.rows, real, strict=True):
            self.lengths[r] += n
        self.bind(self.rows)  # a next forward on the same rows sees the new lengths
