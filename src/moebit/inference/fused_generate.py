"""A ``generate`` batch in as few native calls as it allows: the prefill, and greedy
decoding in calls of up to ``CALL_STEPS`` steps (``_greedy_c.fd_greedy``).

    logits_BV = prefill(model, cache, prompts)             # None: the modules prefill
    run = greedy_steps(model, cache, last, budgets, eos)   # None: step in Python instead
    run.tokens[r], run.step_s

Why: with the native step attached, the Python around each step (module call, the
step's tensors, argmax, bookkeeping) is 10-20% of a small MoE's token at batch 1. When
every row is greedy and only token ids can stop a row, nothing between two steps needs
Python, so the steps run back to back in C, 64 to a call, each timed there. The tokens
are the ones the step-by-step loop gives: the same native step, the same first-maximum
argmax.

The prefill: the serving engine runs prompt chunks through the native step, and
``generate`` does the same, so a prompt meets the same arithmetic (the same sums in the
same order) in both and gets the same greedy text. With ``int8_activations`` the modules
could not give it at all. Where measured it is also faster (docs/benchmarks/decode.md):
each expert's weights are read once per call of up to ``MAX_ROWS`` tokens, and the
float32 products run in register tiles.
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moebit.inference.fused_decode import MAX_ROWS, FusedDecode
from moebit.models.kv_cache import DecodeRows, KVCache

# steps per native call: the Python between calls is negligible against 64 steps, and a
# Ctrl-C, or a serving thread that shares the model (the step's lock), waits for one
# call, not for a whole generation
CALL_STEPS = 64


@dataclass
class GreedyRun:
    tokens: list[list[int]]  # each row's new tokens, in order (empty for a row not live)
    step_s: list[float]  # each step's wall time, argmax included


def greedy_steps(model: torch.nn.Module, cache: KVCache, last: Sequence[int],
                 budgets: Sequence[int], eos: Collection[int],
                 max_steps: int | None = None) -> GreedyRun | None:
    """Decode the live rows of ``cache`` greedily, row r fed ``last[r]`` first, until each
    has ``budgets[r]`` more tokens or took an id in ``eos``, or ``max_steps`` steps ran
    (default ``CALL_STEPS``); finished rows are marked in ``cache`` (``finish``) and the
    cache has advanced by the steps run. None when the native step cannot serve this
    cache (not attached, RoPE recomputed per step, rows the step does not take): the
    caller then steps in Python, from the same state."""
    fused = getattr(model, "decode_step", None)
    b = cache.batch
    if not isinstance(fused, FusedDecode) or not fused.tabled or len(last) != b or len(budgets) != b:
        return None
    steps = max((n for n, alive in zip(budgets, cache.live, strict=True) if alive), default=0)
    steps = min(steps, CALL_STEPS if max_steps is None else max_steps)
    if steps < 1 or steps > cache.capacity - cache.filled:
        return None
    ids = torch.tensor(list(last), dtype=torch.long)
    rows = fused.decode_rows(ids[:, None], cache)
    if rows is None:
        return None
    live = torch.tensor(cache.live, dtype=torch.uint8)
    out = torch.zeros(b, steps, dtype=torch.long)
    nout = torch.zeros(b, dtype=torch.long)
    t_ns = torch.zeros(steps, dtype=torch.long)
    eos_t = torch.tensor(sorted(eos), dtype=torch.long)
    budget_t = torch.tensor(list(budgets), dtype=torch.long)
    logits = torch.empty(b, fused.struct.vocab)
    with fused.lock:
        cos, sin, slot, first, col, kc, vc, threads = fused.native_args(rows, b)
        col = col.clone()  # advanced in place, one column a step
        ran = fused.lib.fd_greedy(
            ctypes.byref(fused.struct), b, ids.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            cos.shape[-1], slot.data_ptr(), first.data_ptr(), col.data_ptr(), live.data_ptr(),
            kc, vc, cache.capacity, logits.data_ptr(), threads, steps,
            eos_t.data_ptr() if eos_t.numel() else None, eos_t.numel(), budget_t.data_ptr(),
            out.data_ptr(), nout.data_ptr(), t_ns.data_ptr())
        if ran == -3:
            raise IndexError(f"a token id of {list(last)} is outside the vocabulary "
                             f"({fused.struct.vocab})")
        if ran < 0:
            raise RuntimeError(f"native greedy decoding refused its arguments (code {-ran})")
        cache.advance(ran)
        fused.steps += ran
    for r, alive in enumerate(live.tolist()):
        if not alive:
            cache.finish(r)
    counts = nout.tolist()
    return GreedyRun([out[r, :counts[r]].tolist() for r in range(b)],
                     (t_ns[:ran].double() / 1e9).tolist())


def prefill(model: torch.nn.Module, cache: KVCache,
            prompts: Sequence[Sequence[int]]) -> torch.Tensor | None:
    """Write the left-padded ``prompts`` into the empty ``cache`` (row i's tokens end at
    the last column of the longest) in native calls of at most ``MAX_ROWS`` tokens and
    return each row's last-token logits [B, V]; None (the cache untouched) unless the
    attached step serves this cache."""
    fused = getattr(model, "decode_step", None)
    if (not isinstance(fused, FusedDecode) or not fused.tabled
            or torch.is_grad_enabled() or model.training or cache.filled
            or len(prompts) != cache.batch or not all(prompts)):
        return None
    t = max(map(len, prompts))
    if t > cache.capacity or cache.starts != [t - len(p) for p in prompts]:
        return None
    if not fused.serves(cache):
        return None
    logits = torch.empty(len(prompts), fused.struct.vocab)
    with fused.lock:
        for group in _groups(prompts, t):
            _prefill_call(fused, cache, prompts, t, group, logits)
    for i, s in enumerate(cache.starts):  # padding: zeros, never stale memory, for the modules
        for buf in (*cache.k, *cache.v) if s else ():
            buf[i, :, :s] = 0
    cache.advance(t)
    return logits


def pack_calls(pieces: list[tuple[Any, int]], cap: int) -> list[list[tuple[Any, int]]]:
    """(key, tokens) pieces, in their order, in groups of at most ``cap`` tokens, one
    native call each: a piece that does not fit is cut, its rest opening the next group,
    so a cut piece's parts run in order. The prefill here and the serving engine's
    packed steps (``serve.ragged.native_groups``) both cut their tokens with it."""
    groups: list[list[tuple[Any, int]]] = [[]]
    room = cap
    for key, n in pieces:
        while n > 0:
            if room == 0:
                groups.append([])
                room = cap
            take = min(n, room)
            groups[-1].append((key, take))
            n, room = n - take, room - take
    return [g for g in groups if g]


def _groups(prompts: Sequence[Sequence[int]], t: int) -> list[list[tuple[int, int, int]]]:
    """(row, first column, tokens) pieces in calls of at most ``MAX_ROWS`` tokens, every
    row's pieces in column order (a later piece attends to the earlier ones)."""
    col = [t - len(p) for p in prompts]  # each row's next column to write
    groups = []
    for group in pack_calls([(i, len(p)) for i, p in enumerate(prompts)], MAX_ROWS):
        pieces = []
        for i, n in group:
            pieces.append((i, col[i], n))
            col[i] += n
        groups.append(pieces)
    return groups


def _prefill_call(fused: FusedDecode, cache: KVCache, prompts: Sequence[Sequence[int]], t: int,
                  group: list[tuple[int, int, int]], logits: torch.Tensor) -> None:
    """One native call of ``group``'s pieces (columns up to ``t``); a piece that ends its
    row writes that row's logits."""
    ids, slot, first, col, heads, last_rows = [], [], [], [], [], []
    for i, c0, n in group:
        s = cache.starts[i]
        ids += prompts[i][c0 - s:c0 - s + n]
        slot += [i] * n
        first += [s] * n
        col += range(c0, c0 + n)
        if c0 + n == t:
            heads.append(len(ids) - 1)
            last_rows.append(i)
    rows = DecodeRows(cache, torch.tensor(slot), torch.tensor(first), torch.tensor(col), None)
    out = fused.run(torch.tensor(ids, dtype=torch.long), rows,
                    torch.tensor(heads, dtype=torch.long))
    if last_rows:
        logits[last_rows] = out
