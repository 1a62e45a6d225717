"""The most continuous batching can gain over static batching on this machine and model.

``moebit bench serve`` prints this bound beside its measured server / static ratio.

Why: continuous batching wins by keeping every step full. Static batching decodes each
batch to its longest request, so its later steps carry few live rows: with outputs of
8-128 tokens a batch of 32 is about 40% live on average. That is worth up to 1 / 0.4 =
2.6x only where a step costs the same whatever its rows (a GPU, or a CPU reading weights
that dwarf the rows' arithmetic). On a few CPU cores a step's cost grows with its rows:
each row does its own arithmetic, and with many experts each row reads its own experts.
Then static batching's emptier steps are cheaper too, and the bound falls toward 1.

The bound here is for decoding only, from measured step times: ``step_costs`` times a
native decode step of n rows for n = 1, 2, 4, ... (``generate_tokens``, greedy, each
row's median step), and ``decode_bound`` replays the workload's output lengths through
both schedules, with the cost of a step of n live rows interpolated between those
points. Static batching's finished rows are counted free, and neither side's prefill is
counted, so the true gain is at most this.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Any

import torch

from moebit.inference.generate import generate_tokens


def step_costs(model: Any, max_rows: int, vocab: int, prompt: int = 16,
               steps: int = 24) -> dict[int, float]:
    """Median ms of a decode step of n rows, for n = 1, 2, 4, ... and ``max_rows``."""
    ns = sorted({*(2 ** i for i in range(max_rows.bit_length()) if 2 ** i <= max_rows), max_rows})
    out = {}
    for n in ns:
        g = torch.Generator().manual_seed(n)
        prompts = torch.randint(0, vocab, (n, prompt), generator=g).tolist()
        r = generate_tokens(model, prompts, max_new_tokens=steps, temperature=0, batch_size=n,
                            eos=[])
        out[n] = 1e3 * statistics.median(r.per_step_s)
    return out


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
    request; a step costs its live rows) and of continuous batching (``slots`` slots
    refilled from the queue as requests finish), and their ratio: the most the server
    can gain. ``uniform_bound``: the same ratio where a step costs the same at any rows."""
    if batch < 1 or slots < 1 or any(b < 1 for b in budgets):
        raise ValueError(f"decode_bound: batch {batch}, slots {slots} and every budget must be >= 1")
    static = uniform_static = 0.0
    for i in range(0, len(budgets), batch):
        chunk = budgets[i:i + batch]
        for s in range(max(chunk)):
            static += _cost(costs, sum(b > s for b in chunk))
            uniform_static += 1
    cont = uniform_cont = 0.0
    queue, live = list(budgets), []
    while queue or live:
        while len(live) < slots and queue:
            live.append(queue.pop(0))
        cont += _cost(costs, len(live))
        uniform_cont += 1
        live = [b - 1 for b in live if b > 1]
    return {"static_ms": round(static, 1), "continuous_ms": round(cont, 1),
            "bound": round(static / cont, 3), "uniform_bound": round(uniform_static / uniform_cont, 3)}
