"""How an exact sharded collective travels: the backend's own, or an all-to-all, chosen by
measuring both on the ranks that run it.

Why: on gloo a reduce-scatter of a 3.24M-float unit took 61 ms where an all-to-all of the
same buffer plus a local sum of the W chunks took 25 ms, and the allreduce of a
replicated run 34 ms. Both move (W-1)/W of the buffer per rank; gloo's reduce-scatter is
just a slower algorithm. On NCCL the native collective is the one to keep. Which wins
depends on the backend, the world, the size and the machine, so it is measured, not
assumed:

* the first call of a unit for a (backend, world, dtype, size bucket) asks group rank 0
  for a remembered choice (``moebit.moe.autotune``'s file, keyed by the machine);
* unknown there, every rank of the group times both candidates on the unit's buffers
  (interleaved rounds), the times are max-reduced so that every rank sees the same
  figures, the fastest is kept, and rank 0 remembers it;
* the choice is broadcast from group rank 0, so ranks never disagree (a rank with another
  cache, on another node, follows rank 0).

With ``MOEBIT_AUTOTUNE=0`` nothing is measured and the backend's collective is used.
The sums differ in their order (an all-to-all sums the W contributions in rank order), so
a checkpointed run resumes bit-exact as long as the choice is the same; it is remembered
per machine, so the same machine makes the same choice.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from moebit.moe import autotune
from moebit.training.shard_config import TRANSPORTS

ROUNDS = 3  # interleaved timed rounds per candidate, after one warm-up


Collective = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], None]


def reduce_scatter_native(out: torch.Tensor, inp: torch.Tensor,
                          group: dist.ProcessGroup) -> None:
    dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_a2a(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` = the sum over ranks of chunk ``rank`` of ``inp`` ([W * C] -> [C]), through
    one all-to-all and a local sum in rank order."""
    got = torch.empty_like(inp)
    dist.all_to_all_single(got, inp, group=group)
    torch.sum(got.view(dist.get_world_size(group), -1), 0, out=out.view(-1))


def all_gather_native(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_gather_single(out, inp, group=group)


def all_gather_a2a(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` = every rank's ``inp`` in rank order, through one all-to-all (this rank's
    shard sent to each rank)."""
    dist.all_to_all_single(out, inp.repeat(dist.get_world_size(group)), group=group)


TRANSPORT_RS: dict[str, Collective] = {"native": reduce_scatter_native, "a2a": reduce_scatter_a2a}
TRANSPORT_AG: dict[str, Collective] = {"native": all_gather_native, "a2a": all_gather_a2a}


class Transport:
    """One unit's choice of transport per buffer (size, dtype): fixed, or ``auto``
    (measured on first use, the same on every rank: ``agreed_choice``)."""

    def __init__(self, what: str, collectives: dict[str, Collective], transport: str = "auto"
                 ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.what, self.collectives, self.transport = what, collectives, transport
        self.chosen: dict[tuple[int, torch.dtype], str] = {}

    def __call__(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> str:
        key = (inp.numel(), inp.dtype)
        if self.transport != "auto":
            self.chosen[key] = self.transport
        elif key not in self.chosen:
            scratch_in, scratch_out = torch.zeros_like(inp), torch.empty_like(out)
            self.chosen[key] = agreed_choice(
                problem_key(self.what, group, inp.numel(), inp.dtype), group,
                {name: functools.partial(fn, scratch_out, scratch_in, group)
                 for name, fn in self.collectives.items()})
        return self.chosen[key]


_NAMES = ("native", "a2a")  # broadcast as 1 + index; 0: not known, measure


def _code(name: str | None) -> int:
    return 1 + _NAMES.index(name) if name in _NAMES else 0


def agreed_choice(problem: str, group: dist.ProcessGroup,
                  candidates: dict[str, Callable[[], object]]) -> str:
    """The transport every rank of ``group`` uses for ``problem``; collective."""
    src = dist.get_global_rank(group, 0)
    first = dist.get_group_rank(group, dist.get_rank()) == 0
    if not autotune.enabled():
        choice: str | None = "native"
    else:  # only rank 0's file counts (cached is None where tuning is off)
        known = autotune.cached(problem) if first else None
        choice = known.choice if known else None
    flag = torch.tensor([_code(choice)], dtype=torch.int64)
    dist.broadcast(flag, src, group=group)
    if int(flag) == 0:
        times = torch.zeros(len(candidates), dtype=torch.float64)
        for fn in candidates.values():
            fn()
        for _ in range(ROUNDS):
            for i, fn in enumerate(candidates.values()):
                dist.barrier(group=group)
                t = time.perf_counter()
                fn()
                times[i] += time.perf_counter() - t
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        names = list(candidates)
        best = names[int(torch.argmin(times))]
        if first:
            autotune.remember(problem, best, {n: float(t) / ROUNDS for n, t in zip(names, times,
                                                                               strict=True)})
        return best
    return _NAMES[int(flag) - 1]


def problem_key(what: str, group: dist.ProcessGroup, numel: int, dtype: torch.dtype) -> str:
    """The remembered choice's key: collective, backend, world, dtype, size bucket."""
    backend = dist.get_backend(group)
    world = dist.get_world_size(group)
    return (f"fsdp-{what}|{backend}|world{world}|{str(dtype).removeprefix('torch.')}"
            f"|n{autotune.rows_bucket(numel)}")


