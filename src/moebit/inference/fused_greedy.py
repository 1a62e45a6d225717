"""A ``generate`` batch's greedy decoding in one native call (``_greedy_c.fd_greedy``).

    run = greedy_steps(model, cache, last, budgets, eos)   # None: step in Python instead
    run.tokens[r], run.step_s

Why: with the native step attached, the Python around each step (module call, the
step's tensors, argmax, bookkeeping) is 10-20% of a small MoE's token at batch 1. When
every row is greedy and only token ids can stop a row, nothing between two steps needs
Python, so the steps run back to back in C, each timed there. The tokens are the ones
the step-by-step loop gives: the same native step, the same first-maximum argmax.
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from moebit.inference.fused_decode import FusedDecode
from moebit.models.kv_cache import KVCache


@dataclass
class GreedyRun:
    tokens: list[list[int]]  # each row's new tokens, in order (empty for a row not live)
    step_s: list[float]  # each step's wall time, argmax included


def greedy_steps(model: torch.nn.Module, cache: KVCache, last: Sequence[int],
                 budgets: Sequence[int], eos: Collection[int]) -> GreedyRun | None:
    """Decode the live rows of ``cache`` greedily, row r fed ``last[r]`` first, until each
    has ``budgets[r]`` more tokens or took an id in ``eos``; finished rows are marked in
    ``cache`` (``finish``) and the cache has advanced by the steps run. None when the
    native step cannot serve this cache (not attached, RoPE recomputed per step, rows the
    step does not take): the caller then steps in Python, from the same state."""
    fused = getattr(model, "decode_step", None)
    b = cache.batch
    if not isinstance(fused, FusedDecode) or not fused.tabled or len(last) != b or len(budgets) != b:
        return None
    steps = max((n for n, alive in zip(budgets, cache.live, strict=True) if alive), default=0)
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
