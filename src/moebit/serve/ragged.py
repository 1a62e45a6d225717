"""One forward over a ragged batch: decode rows and prefill chunks packed in one row.

    view = RaggedView(cache, [(3, 1), (5, 1), (0, 40)])   # slots 3, 5 decode; slot 0: 40 tokens
    ids_1N = torch.tensor([[t3, t5, *chunk0]])              # N = 42 tokens, packed
    logits = model(ids_1N, cache=view, logits_to_keep=torch.tensor([0, 1, 41])).logits

Why: the engine used to run one forward for its decode rows and another for its prefill
chunks (right-padded to the longest), so each step paid two passes over the weights and
the padding's projections. Packed, every projection, norm and feed-forward runs once on
exactly the N real tokens; only attention is split, because each token may see only its
own slot's keys (a varlen causal mask):

- every segment of one token (a decode row, or a prompt's last token) sees its slot's
  cached columns and itself: all of them in one attention over the slot buffers 0 .. the
  highest such slot (a view, not a gathered copy), masked by each slot's length; slots in
  that range with no such token ride along as dummy rows whose output is dropped;
- a chunk of n > 1 tokens at column L of its slot sees columns 0 .. L + i: one attention
  of n queries over that slot's first L + n columns (plain causal when L = 0).

The view speaks the cache interface a model drives (``longest``, ``positions``,
``attend``, ``ffn_rows``, ``advance``), so moebit's GPT and every Hugging Face decoder run
it unchanged; a family with its own attention keeps calling ``cache.attend``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moebit.inference.fused_generate import pack_calls
from moebit.models.kv_cache import DecodeRows, sdpa
from moebit.serve.slot_cache import SlotKVCache


class RaggedView:
    """One forward's packed segments (slot, new tokens) over a ``SlotKVCache``."""

    def __init__(self, cache: SlotKVCache, segments: Sequence[tuple[int, int]]) -> None:
        slots = [s for s, _ in segments]
        if len(set(slots)) != len(slots):
            raise ValueError(f"RaggedView: a slot appears twice in {slots}")
        if any(n < 1 for _, n in segments):
            raise ValueError(f"RaggedView: every segment needs >= 1 token, got {list(segments)}")
        self.cache, self.segments = cache, [(int(s), int(n)) for s, n in segments]
        self.n = sum(n for _, n in self.segments)
        starts, at = [], 0
        for _, n in self.segments:
            starts.append(at)
            at += n
        self.starts = starts
        lens = cache.lengths
        self.chunks = [(i, s, n, lens[s]) for i, (s, n) in zip(starts, self.segments, strict=True)
                       if n > 1]
        # the tensors of the module path's attention, made on first use: a step that a
        # native decode step serves (``decode_rows``) never needs them
        self._pos_N: torch.Tensor | None = None
        self._index: torch.Tensor | None = None

    @property
    def pos_N(self) -> torch.Tensor:
        """[N] each packed token's position in its own slot."""
        if self._pos_N is None:
            lens = self.cache.lengths
            self._pos_N = (torch.cat([torch.arange(lens[s], lens[s] + n) for s, n in self.segments])
                           if self.segments else torch.zeros(0, dtype=torch.long)
                           ).to(self.cache.k[0].device)
        return self._pos_N

    def _attention_tensors(self) -> torch.Tensor:
        """The module path's write index (where token i's key/value of head j goes in a
        buffer viewed as [-1, Dh]) and the one-token segments' batched attention, made
        once per forward by the first layer that attends."""
        if self._index is None:
            dev = self.cache.k[0].device
            slot_N = (torch.cat([torch.full((n,), s) for s, n in self.segments])
                      if self.segments else torch.zeros(0, dtype=torch.long)).to(dev)
            _, h, c, _ = self.cache.k[0].shape
            heads_H = torch.arange(h, device=dev)
            self._index = ((slot_N[None] * h + heads_H[:, None]) * c + self.pos_N[None]).reshape(-1)
            ones = [(i, s) for i, (s, n) in zip(self.starts, self.segments, strict=True) if n == 1]
            self._ones(ones, dev)
        return self._index

    def _ones(self, ones: list[tuple[int, int]], dev: torch.device) -> None:
        """The one-token segments' batched attention: packed index, slot rows, mask."""
        self.one_tok = torch.tensor([i for i, _ in ones], dtype=torch.long, device=dev)
        self.one_slot = torch.tensor([s for _, s in ones], dtype=torch.long, device=dev)
        self.rows = max((s for _, s in ones), default=-1) + 1  # slot buffers 0 .. rows - 1
        lens = self.cache.lengths
        self.keys = max((lens[s] for _, s in ones), default=-1) + 1  # columns they see
        self.one_mask = None
        len_R = torch.tensor(lens[:self.rows], dtype=torch.long, device=dev)
        if self.rows and (self.rows != len(ones) or len(set(len_R.tolist())) > 1):
            key_S = torch.arange(self.keys, device=dev)
            self.one_mask = (key_S[None] <= len_R[:, None])[:, None, None]  # [R, 1, 1, S]

    # ------------------------------------------------------------ the cache interface

    def longest(self, t: int) -> int:
        """The longest slot once this forward is in (the model checks its context)."""
        self._check(t)
        lens = self.cache.lengths
        return max((lens[s] + n for s, n in self.segments), default=0)

    def positions(self, t: int, limit: int | None = None) -> torch.Tensor:
        """[1, N]: each packed token's position in its own slot."""
        self._check(t)
        if self.n and int(self.pos_N.max()) >= self.cache.capacity:
            raise ValueError(f"SlotKVCache holds {self.cache.capacity} columns per slot: "
                             f"position {int(self.pos_N.max())} does not fit")
        return self.pos_N.clamp(0, limit)[None]

    def ffn_rows(self, t: int) -> None:
        """Every packed token is real: the feed-forward runs on all of them."""
        return None

    def attend(self, layer: int, q_1HNd: torch.Tensor, k_1HNd: torch.Tensor,
               v_1HNd: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Write the N new keys/values into their slots' columns, then attend per group."""
        kb, vb = self.cache.k[layer], self.cache.v[layer]
        dh = kb.shape[-1]
        index = self._attention_tensors()
        kb.view(-1, dh).index_copy_(0, index, k_1HNd[0].reshape(-1, dh).to(kb.dtype))
        vb.view(-1, dh).index_copy_(0, index, v_1HNd[0].reshape(-1, dh).to(vb.dtype))
        y = torch.empty_like(q_1HNd)
        if self.rows:
            q_RH1d = q_1HNd.new_zeros(self.rows, q_1HNd.shape[1], 1, q_1HNd.shape[3])
            q_RH1d.index_copy_(0, self.one_slot, q_1HNd[0, :, self.one_tok].transpose(0, 1)[:, :, None])
            out_RH1d = sdpa(q_RH1d, kb[:self.rows, :, :self.keys], vb[:self.rows, :, :self.keys],
                            self.one_mask, False, scale)
            y[0, :, self.one_tok] = out_RH1d.index_select(0, self.one_slot)[:, :, 0].transpose(0, 1)
        for i, s, n, start in self.chunks:
            mask = None
            if start:
                key_S = torch.arange(start + n, device=kb.device)
                query_T = torch.arange(start, start + n, device=kb.device)
                mask = (key_S[None] <= query_T[:, None])[None, None]
            y[:, :, i:i + n] = sdpa(q_1HNd[:, :, i:i + n], kb[s:s + 1, :, :start + n],
                                    vb[s:s + 1, :, :start + n], mask, start == 0, scale)
        return y

    def decode_rows(self, b: int, t: int) -> DecodeRows | None:
        """The packed step as rows of one token ([1, N] ids): token i of a segment writes
        its slot's column L + i (L the slot's length) and sees the slot's columns up to
        it, so a prompt chunk is rows of one slot at consecutive columns (the native step
        writes every row's key before any row attends)."""
        if b != 1 or t != self.n or not self.n:
            return None
        lens = self.cache.lengths
        if max(lens[s] + n for s, n in self.segments) > self.cache.capacity:
            self.positions(t)  # raises: a slot is full
        slot = torch.cat([torch.full((n,), s, dtype=torch.long) for s, n in self.segments])
        col = torch.cat([torch.arange(lens[s], lens[s] + n) for s, n in self.segments])
        return DecodeRows(self.cache, slot, torch.zeros(t, dtype=torch.long), col, None)

    def advance(self, t: int) -> None:
        self._check(t)
        for s, n in self.segments:
            self.cache.lengths[s] += n

    def _check(self, t: int) -> None:
        if t != self.n:
            raise ValueError(f"RaggedView: the forward has {t} tokens, its segments {self.n}")


def native_groups(plan: list[tuple[Any, int]], cap: int) -> list[list[tuple[Any, int]]]:
    """The engine's step ``plan`` ((request, tokens) pairs) in groups of at most ``cap``
    tokens, one native call each (``fused_generate.pack_calls``): decode rows (a request
    whose prompt is in) first; a prompt chunk that does not fit is cut, its rest opening
    the next group."""
    return pack_calls(sorted(plan, key=lambda rn: rn[0].prefilled < len(rn[0].prompt)), cap)
