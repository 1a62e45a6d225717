"""The most continuous batching can gain over static batching on this machine and model.

``moebit bench serve`` prints this bound beside its measured server / static ratio.

Why: continuous batching wins by keeping every step full. Static batching decodes each
batch to its longest request: with outputs of 8-128 tokens a batch of 32 is about 40%
live on average. The baseline the benchmark measures (``generate_tokens`` with one
``max_new_tokens`` per batch, as ``moebit generate --batch`` and transformers' batched
``generate`` run) computes every row of the batch at every step, finished or not. So
against it, continuous batching can gain up to 1 / 0.4 = 2.6x whatever a step's cost
curve: ``bound``.

A smarter static batcher would stop computing its finished rows. Against it the gain
depends on how a step's cost grows with its rows: up to 2.6x where a step costs the
same whatever its rows (a GPU, or a CPU reading weights that dwarf the rows'
arithmetic), toward 1 where each row pays its own arithmetic and, with many experts,
reads its own experts: ``bound_vs_live``.

Both are for decoding only, from measured step times: ``step_costs`` times a native
decode step of n rows for n = 1, 2, 4, ... (``generate_tokens``, greedy, each row's
median step), and ``decode_bound`` replays the workload's output lengths through the
schedules, the cost of a step of n rows interpolated between those points. Neither
side's prefill is counted.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Any

import torch

from moebit.inference.generate import generate_tokens


def step_costs(model: Any, max_rows: int, vocab: int, prompt: int = 16,
               steps: int = 24, rounds: int = 3) -> dict[int, float]:
    """Median ms of a decode step of n rows, for n = 1, 2, 4, ... and ``max_rows``: the
    median over ``rounds`` sweeps of every n, so a moment of a busy host falls on one
    sweep's figure of each n rather than on all of one n's (a bent curve bends the bound)."""
    ns = sorted({*(2 ** i for i in range(max_rows.bit_length()) if 2 ** i <= max_rows), max_rows})
    seen: dict[int, list[float]] = {n: [] for n in ns}
    for _ in range(rounds):
        for n in ns:
            g = torch.Generator().manual_seed(n)
            prompts = torch.randint(0, vocab, (n, prompt), generator=g).tolist()
            r = generate_tokens(model, prompts, max_new_tokens=steps, temperature=0,
                                batch_size=n, eos=[])
            seen[n] += r.per_step_s
    return {n: 1e3 * statistics.median(t) for n, t in seen.items()}


def _cost(costs: dict[int, float], n: int) -> float:
    """A step of n rows: linear between the measured counts (beyond them, along the
    nearest segment); one measured count: proportional; no rows cost nothing."""
    if n <= 0:
        return 0.0
    xs = sorted(costs)
    if len(xs) == 1:
        return costs[xs[0]] * n / xs[0]
    i = min(max(bisect.bisect_left(xs, n) - 1, 0), len(xs) - 2)  # the segment n falls on
    lo, hi = xs[i], xs[i + 1]
    return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


def decode_bound(budgets: list[int], batch: int, slots: int,
                 costs: dict[int, float]) -> dict[str, float]:
    """Decode time of static batching (batches of ``batch`` in order, each to its longest
    request) and of continuous batching (``slots`` slots refilled from the queue as
    requests finish), and their ratios: ``bound`` against static batching that computes
    every row of a batch at every step (the measured baseline), ``bound_vs_live`` against
    one whose finished rows cost nothing, ``uniform_bound`` where a step costs the same
    at any rows."""
    if batch < 1 or slots < 1 or any(b < 1 for b in budgets):
        raise ValueError(f"decode_bound: batch {batch}, slots {slots} and every budget must be >= 1")
    static = static_live = uniform_static = 0.0
    for i in range(0, len(budgets), batch):
        chunk = budgets[i:i + batch]
        for s in range(max(chunk)):
            static += _cost(costs, len(chunk))
            static_live += _cost(costs, sum(b > s for b in chunk))
            uniform_static += 1
    cont = uniform_cont = 0.0
    queue, live = list(budgets), []
    while queue or live:
        while len(live) < slots and queue:
            live.append(queue.pop(0))
        cont += _cost(costs, len(live))
        uniform_cont += 1
        live = [b - 1 for b in live if b > 1]
    return {"static_ms": round(static, 1), "static_live_ms": round(static_live, 1),
            "continuous_ms": round(cont, 1), "bound": round(static / cont, 3),
            "bound_vs_live": round(static_live / cont, 3),
            "uniform_bound": round(uniform_static / uniform_cont, 3)}
