"""Prefix caching: a prompt prefix's keys/values computed once and copied into later slots.

    pc = PrefixCache(max_tokens=4096, block=16)
    keys = pc.block_keys(prompt)                  # one chained key per full block of 16 ids
    n = pc.load(cache, slot, prompt, keys)        # columns 0 .. n filled from the cache
    pc.store(cache, slot, prompt, keys, upto)     # after prefilling: its full blocks kept

Why: requests to one server often share a prefix (a system prompt, a few-shot header).
Its keys/values depend only on its tokens, so prefilling it again is wasted compute and
time to first token. The cache keeps them per block of ``block`` token ids: block i's
key chains every id before it (a BLAKE2 digest of the parent's digest and the block's
ids, and the ids themselves are compared on a hit), so a hit is exactly the same tokens
at the same positions. A hit copies the blocks into the slot's first columns; the slot
then prefills only the rest (at least one token: its last logits start decoding).

Bounded: at most ``max_tokens`` tokens (blocks x block) are held; the least recently used
block goes first. A walk touches a chain's blocks deepest first, so a prefix's root is
always more recent than its leaves and eviction trims chains from their ends.
Memory: ``max_tokens`` x layers x 2 x kv heads x head size x the dtype's bytes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moebit.serve.slot_cache import SlotKVCache


@dataclass
class _Block:
    ids: tuple[int, ...]
    k: torch.Tensor  # [layers, kv heads, block, Dh]
    v: torch.Tensor


class PrefixCache:
    def __init__(self, max_tokens: int, block: int = 16) -> None:
        if max_tokens < 0 or block < 1:
            raise ValueError(f"PrefixCache: max_tokens ({max_tokens}) must be >= 0 and "
                             f"block ({block}) >= 1")
        self.max_blocks, self.block = max_tokens // block, block
        self.blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.lookups = self.hits = self.tokens_reused = 0

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block

    def block_keys(self, ids: Sequence[int]) -> list[bytes]:
        """One key per full block of ``ids``: the digest of its parent's key and its ids."""
        keys, parent = [], b""
        for i in range(0, len(ids) - self.block + 1, self.block):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(array("q", ids[i:i + self.block]).tobytes())
            parent = h.digest()
            keys.append(parent)
        return keys

    def _chain(self, ids: Sequence[int], keys: list[bytes], limit: int) -> list[_Block]:
        """The cached blocks that start ``ids``, at most ``limit`` of them."""
        out = []
        for i, key in enumerate(keys[:limit]):
            b = self.blocks.get(key)
            if b is None or b.ids != tuple(ids[i * self.block:(i + 1) * self.block]):
                break
            out.append(b)
        for key in reversed(keys[:len(out)]):  # deepest first: the root ends most recent
            self.blocks.move_to_end(key)
        return out

    def load(self, cache: SlotKVCache, slot: int, ids: Sequence[int], keys: list[bytes]) -> int:
        """Copy the longest cached prefix of ``ids`` (leaving one token at least) into
        ``slot``'s first columns and set its length; the tokens reused (0: a miss)."""
        if not self.max_blocks:
            return 0
        self.lookups += 1
        chain = self._chain(ids, keys, (len(ids) - 1) // self.block)
        for j, b in enumerate(chain):
            cols = slice(j * self.block, (j + 1) * self.block)
            for layer in range(len(cache.k)):
                cache.k[layer][slot, :, cols] = b.k[layer]
                cache.v[layer][slot, :, cols] = b.v[layer]
        n = len(chain) * self.block
        cache.lengths[slot] = n
        if n:
            self.hits += 1
            self.tokens_reused += n
        return n

    def store(self, cache: SlotKVCache, slot: int, ids: Sequence[int], keys: list[bytes],
              upto: int) -> None:
        """Keep the full blocks among ``slot``'s first ``upto`` columns (they hold ``ids``'
        keys/values) that the cache lacks, evicting the least recently used."""
        n_blocks = min(upto // self.block, len(keys), self.max_blocks)
        have = len(self._chain(ids, keys, n_blocks))
        for j in range(have, n_blocks):
            cols = slice(j * self.block, (j + 1) * self.block)
            self.blocks[keys[j]] = _Block(tuple(ids[j * self.block:(j + 1) * self.block]),
                                          torch.stack([k[slot, :, cols] for k in cache.k]),
                                          torch.stack([v[slot, :, cols] for v in cache.v]))
        for key in reversed(keys[:n_blocks]):  # deepest first, as a walk touches them
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
