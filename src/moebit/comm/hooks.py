"""DDP communication hooks: 1-bit gradient allreduce, and warm-up-then-silent for 1-bit Adam.

``onebit_hook`` compresses each DDP gradient bucket with the error-compensated 1-bit
allreduce after ``start_iter`` exact iterations (in the manner of torch's PowerSGD hook):

    state = OnebitHookState(process_group=None, start_iter=10)
    ddp.register_comm_hook(state, onebit_hook)

Why a warm-up: DDP rebuilds its buckets after the first iteration (a bucket's length can
change, which would restart its error buffers), and the first steps of training move the
most, when compression hurts the most.

``freezable_allreduce_hook`` is for optimizers that exchange compressed momentum themselves
(1-bit Adam): exact averaged gradients until ``state.freeze()``, then the local gradient
with no communication at all, so gradients never cross the network twice.

Both states pickle without their process group (``__getstate__``/``__setstate__``, as
PowerSGDState does); after unpickling they use the default group. The 1-bit state's error
buffers travel with it, per rank: every rank must save and load its own.

Note: the 1-bit path runs synchronously inside the hook, so that bucket's communication
does not overlap the rest of the backward pass.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook inspects the
# hook's annotations and rejects them as strings.
from typing import Any

import torch
import torch.distributed as dist

from moebit.comm import collectives, stats
from moebit.comm.compressed import OnebitAllreduce

__all__ = [
    "OnebitHookState",
    "onebit_hook",
    "FreezableAllreduceState",
    "freezable_allreduce_hook",
]


def _exact_average(
    group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Sum-allreduce the bucket asynchronously and divide by W (gloo has no AVG)."""
    buf = bucket.buffer()
    w = collectives.world_size(group)
    moved = stats.ring_allreduce_bytes(buf.numel() * buf.element_size(), w)
    stats.record("ddp.allreduce", moved, moved)
    if w == 1:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)
        return fut
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0].div_(w))


class OnebitHookState:
    """State of ``onebit_hook``: warm-up length, iteration count, per-bucket error buffers.

    Error buffers are keyed by the bucket index, one pair per bucket.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        start_iter: int = 10,
    ) -> None:
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        self.process_group = process_group
        self.start_iter = start_iter
        self.iter = 0
        self._compressor: OnebitAllreduce | None = None
        self._pending: dict[str, Any] | None = None

    @property
    def compressor(self) -> OnebitAllreduce:
        """The 1-bit allreduce, built at first use (after the process group exists)."""
        if self._compressor is None:
            self._compressor = OnebitAllreduce(self.process_group)
            if self._pending is not None:
                self._compressor.load_state_dict(self._pending)
                self._pending = None
        return self._compressor

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        # DDP hands the buckets of one backward pass in order; the last ends the iteration.
        if bucket.is_last():
            self.iter += 1

    def __getstate__(self) -> dict[str, Any]:
        comp = self._compressor.state_dict() if self._compressor is not None else self._pending
        return {"start_iter": self.start_iter, "iter": self.iter, "compressor": comp}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self.start_iter = state["start_iter"]
        self.iter = state["iter"]
        self._compressor = None
        self._pending = state["compressor"]


def onebit_hook(
    state: OnebitHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Exact averaged allreduce for ``state.start_iter`` iterations, then 1-bit per bucket."""
    if state.iter < state.start_iter:
        fut = _exact_average(state.process_group, bucket)
    else:
        buf = bucket.buffer()
        state.compressor.allreduce(buf, name=f"bucket{bucket.index()}", out=buf)
        fut = torch.futures.Future()
        fut.set_result(buf)
    state.maybe_increase_iter(bucket)
    return fut


class FreezableAllreduceState:
    """Exact gradient averaging until ``freeze()``; afterwards the hook communicates nothing.

    1-bit Adam calls ``freeze()`` when it freezes its variance: from then on it averages
    its compressed momentum itself and needs each rank's local gradient.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.frozen = False

    def freeze(self) -> None:
        self.frozen = True

    def unfreeze(self) -> None:
        """Back to exact averaging (e.g. for a step that must see the global gradient)."""
        self.frozen = False

    def __getstate__(self) -> dict[str, Any]:
        return {"frozen": self.frozen}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self.frozen = bool(state["frozen"])


def freezable_allreduce_hook(
    state: FreezableAllreduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Averaged gradients before ``state.freeze()``, the untouched local gradient after."""
    if not state.frozen:
        return _exact_average(state.process_group, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
