"""DiLoCo and Streaming DiLoCo: an outer optimizer around any inner optimizer.

DiLoCo (Douillard et al. 2023, arXiv:2311.08105): each worker takes H inner steps alone;
then the pseudo-gradient Delta = theta_sync - theta_now (theta_sync: the parameters at the
last sync, the same on every worker) is averaged over the outer group and fed to an outer
SGD with Nesterov momentum that starts from theta_sync:

    m     <- mu*m + mean(Delta)
    u     =  mean(Delta) + mu*m        (Nesterov; plain momentum: u = m)
    theta_sync <- theta_sync - lr*u,   and every worker moves to theta_sync.

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) cuts the model into F fragments
of consecutive blocks (or, ``cut="even"``, equal runs of elements); fragment i syncs at
inner steps H + o_i, 2H + o_i, ... with o_i = floor(i*H/F), so the traffic of one sync is
spread over the interval. A fragment's exchange starts at step s and is applied at step
s + D (``delay``): the D inner steps in between run while the pseudo-gradient is on the
wire. The late outer point is mixed into the parameters that moved meanwhile:
theta = alpha*theta_local + (1-alpha)*theta_sync.
Pseudo-gradients may travel in bf16, int8 (INTELLECT-1) or 1 bit with error feedback
(``moebit.optim.outer_compress``).

Sharded parameters (FSDP2 inside each node, INTELLECT-1's layout): a DTensor parameter is
synced through its local shard (``to_local()``), so theta_sync, the momentum and the error
buffers hold this rank's shards only, 1/node of a replica; the outer group pairs the ranks
that hold the same shard on every node. Fragments cut by blocks are balanced by the
parameters' global sizes, so every rank of a node syncs its shards of the same blocks at
the same step; the even cut runs over each rank's own shards.

A node's ranks hold the same dense replica (``outer_group=node`` without sharding). Given
their ``share`` group, each exchanges only its 1/L slice of a fragment's dense
pseudo-gradient over its outer group and the node all-gathers the averaged slices over its
own link, so the slow link carries the model once per sync instead of once per local rank.
Expert parameters (other experts on each rank of the node) travel whole.

Why a separate object rather than a ``torch.optim.Optimizer`` wrapping the inner one: the
training loop sets ``lr`` in every group of its optimizer each step (the schedule), decides
how gradients are averaged from the optimizer's attributes (``averages_gradients``,
``next_step_averages_exactly``), reports 1-bit freezes and saves the optimizer's own state
section. A wrapper would have to forward all of that and its own learning rate would be
overwritten by the inner schedule. So the inner optimizer stays exactly what the loop
already drives, and the loop adds one call per step, ``outer.step()`` after ``opt.step()``,
plus ``outer.state_dict()`` / ``load_state_dict()`` in its checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from moebit.comm import collectives, stats
from moebit.comm.quantize import DEFAULT_BLOCK
from moebit.optim.base import tensors_in
from moebit.optim.outer_compress import make_exchange
from moebit.optim.outer_params import (
    BLOCK_ALIGN,
    Blocks,
    OuterSettings,
    Piece,
    check_inner,
    marked_expert,
    module_blocks,
    split_fragments,
)

__all__ = ["Blocks", "OuterOptimizer", "SyncRecord", "module_blocks"]


@dataclass
class SyncRecord:
    """One finished outer sync, for the loop's metrics (``as_metrics``)."""

    step: int  # the inner step at which the outer update was applied
    started: int  # the inner step at which its exchange started (step - delay)
    fragment: int
    pseudo_grad_norm: float  # ||Delta|| of this rank, before compression
    mean_pseudo_grad_norm: float  # ||mean(Delta)|| as exchanged (the same on the outer group)
    seconds: float  # the exchange itself (in the background when delay > 0)
    wait_seconds: float  # how long the training thread was blocked on it
    bytes_sent: int  # this rank's outer bytes for this sync

    def as_metrics(self) -> dict[str, float]:
        return {f"outer_{k}": v for k, v in asdict(self).items()}


@dataclass
class _Fragment:
    pieces: list[Piece]  # dense ones first, then experts (``dense`` elements dense)
    offset: int
    dense: int  # elements of the dense part
    sync: torch.Tensor  # float32 flat: theta at the last sync (the outer parameters)
    momentum: torch.Tensor  # float32 flat

    def locals(self) -> list[torch.Tensor]:
        """The elements this rank holds, as flat views of the parameters (or of their
        DTensor shards): writing them writes the parameters."""
        return [flat_view(local_tensor(pc.param))[pc.lo:pc.hi] for pc in self.pieces]

    def flat(self) -> torch.Tensor:
        return torch.cat([t.detach().float() for t in self.locals()])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split([pc.hi - pc.lo for pc in self.pieces]))


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one flat view (never a copy: the outer step writes through it)."""
    if not t.is_contiguous():
        raise ValueError(f"outer optimizer: a parameter of shape {tuple(t.shape)} is not "
                         "contiguous, so its elements cannot be synced in place")
    return t.view(-1)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p``: a DTensor's local shard (sharing its storage), else ``p``.
    Duck-typed, so that replicated runs never import DTensor."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


@dataclass
class _Pending:
    """An exchange started and not yet applied."""

    fragment: int
    started: int
    due: int
    local_norm: float
    thread: threading.Thread | None = None
    average: torch.Tensor | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    bytes_sent: int = 0


class OuterOptimizer:
    """DiLoCo / Streaming DiLoCo around ``inner`` (see the module docstring).

    ``blocks``: the parameters to sync, as ``module_blocks`` takes them; every parameter the
    inner optimizer trains must be in one. ``group``: the outer process group (from
    ``moebit.comm.outer_groups.outer_groups``; with ``delay`` > 0 it must be a group no
    other code uses, since the exchange runs in a background thread). All replicas of the
    outer group must hold the same parameters when this is built (broadcast them first).

    Call ``step()`` once per inner step of the loop, after ``opt.step()``, also for a
    step skipped for a non-finite loss (the worker then did not move): the schedule counts
    loop steps, so the workers' syncs meet without agreeing on their skips. ``last_sync``
    is the ``SyncRecord`` of a sync finished at that step, or None. Options: ``every`` H
    (``outer_every``), ``lr``, ``momentum``, ``nesterov``,
    ``compress`` (none | bf16 | int8 | 1bit), ``fragments`` F, ``delay`` D < H/F, ``alpha``
    (mixing of a late update, in [0, 1)), ``int8_block``, ``onebit_block``
    (elements per 1-bit scale; 0: one per chunk, ``moebit.comm.compressed``). ``is_expert`` tells expert
    parameters (default: moebit.moe's mark), which are exchanged apart from dense ones.
    ``share``: the ranks holding this rank's dense replica (its node, with ``outer_group``
    node and no sharding; ``OuterGroups.share``), which split each dense exchange.
    ``cut``: how fragments are cut, ``blocks`` (whole consecutive blocks, the paper's) or
    ``even`` (equal runs of elements: the peak exchange is 1/F of the model).
    """

    def __init__(self, inner: torch.optim.Optimizer, blocks: Blocks,
                 group: dist.ProcessGroup | None = None, *, every: int, lr: float = 0.7,
                 momentum: float = 0.9, nesterov: bool = True, compress: str = "none",
                 fragments: int = 1, delay: int = 0, alpha: float = 0.0,
                 int8_block: int = DEFAULT_BLOCK, onebit_block: int = DEFAULT_BLOCK,
                 is_expert: Callable[[torch.Tensor], bool] = marked_expert,
                 share: dist.ProcessGroup | None = None, cut: str = "blocks") -> None:
        self.settings = OuterSettings(every, lr, momentum, nesterov, compress, fragments, delay,
                                      alpha, int8_block, onebit_block, cut)  # raises if bad
        self.every, self.fragments, self.delay = every, fragments, delay
        self.lr, self.momentum, self.alpha = float(lr), float(momentum), float(alpha)
        self.nesterov, self.compress = nesterov, compress
        self.inner = inner
        self.group = group
        self.world = collectives.world_size(group)
        # Alone in its outer group (one node) a rank has nothing to split.
        self.share = share if self.world > 1 and collectives.world_size(share) > 1 else None
        if self.delay > 0 and group is None and self.world > 1:
            raise ValueError(
                "outer_delay > 0 runs the exchange in a background thread, which must not share "
                "the default process group with the training loop: pass a dedicated outer group "
                "(moebit.comm.outer_groups.outer_groups)")
        parts = split_fragments(module_blocks(blocks), self.fragments, cut, local_tensor)
        check_inner(inner, list({id(pc.param): pc.param for part in parts for pc in part}
                                .values()), group)
        self._frags = []
        for i, pieces in enumerate(parts):
            dense = [pc for pc in pieces if not is_expert(pc.param)]
            experts = [pc for pc in pieces if is_expert(pc.param)]
            frag = _Fragment(dense + experts, (i * self.every) // self.fragments,
                             sum(pc.hi - pc.lo for pc in dense), torch.empty(0), torch.empty(0))
            frag.sync = frag.flat()
            frag.momentum = torch.zeros_like(frag.sync)
            self._frags.append(frag)
        self.exchange = make_exchange(compress, group, int8_block, onebit_block)
        self.step_count = 0  # inner steps taken
        self.sync_count = 0  # outer updates applied (all fragments)
        self.last_sync: SyncRecord | None = None
        self._pending: _Pending | None = None

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(self) -> SyncRecord | None:
        """Count one inner step; finish a due exchange, start a scheduled one."""
        self.step_count += 1
        t = self.step_count
        self.last_sync = None
        if self._pending is not None and self._pending.due == t:
            self._finish(t)
        i = self.fragment_starting_at(t)
        if i is not None:
            self._start(i, t)
        return self.last_sync

    def fragment_starting_at(self, t: int) -> int | None:
        """The fragment whose exchange starts at inner step ``t`` (1-based), if any."""
        if t < self.every:
            return None
        for i, f in enumerate(self._frags):
            if t % self.every == f.offset:
                return i
        return None

    @property
    def in_flight(self) -> bool:
        """Whether an exchange has started and not been applied yet."""
        return self._pending is not None

    @torch.no_grad()
    def synchronize(self) -> None:
        """Make every worker hold the same point now (the end of a run): apply an exchange in
        flight, then sync every fragment at once, without mixing. A collective over the outer
        group: call it on every rank at the same step. Training may go on afterwards; the
        schedule is unchanged."""
        t = self.step_count
        if self._pending is not None:
            self._finish(t)
        for i in range(len(self._frags)):
            self._start(i, t, at_once=True)

    def _start(self, i: int, t: int, at_once: bool = False) -> None:
        frag = self._frags[i]
        self._inner_sync()
        delta = frag.sync - frag.flat()
        pending = _Pending(i, t, t + (0 if at_once else self.delay), float(delta.norm()))
        self._pending = pending
        if at_once or self.delay == 0:
            self._run_exchange(pending, delta)
            self._finish(t, mix=not at_once)
        else:
            pending.thread = threading.Thread(target=self._run_exchange, args=(pending, delta),
                                              name=f"moebit-outer-{i}", daemon=True)
            pending.thread.start()

    def _run_exchange(self, pending: _Pending, delta: torch.Tensor) -> None:
        """The collective part (in a background thread when delay > 0)."""
        try:
            before = _outer_bytes()
            t0 = time.perf_counter()
            pending.average = self._average(delta, self._frags[pending.fragment],
                                            f"fragment{pending.fragment}")
            pending.seconds = time.perf_counter() - t0
            pending.bytes_sent = _outer_bytes() - before
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            pending.error = e

    def _average(self, delta: torch.Tensor, frag: _Fragment, name: str) -> torch.Tensor:
        """Dense and expert parts travel apart: the ranks of a node hold other experts, and
        a compression scale shared with them would make the dense averages differ there."""
        k = frag.dense
        if k == 0:
            return self.exchange.average(delta, name)
        if k == delta.numel():
            return self._average_dense(delta, name)
        return torch.cat([self._average_dense(delta[:k], name),
                          self.exchange.average(delta[k:], f"{name}.expert")])

    def _average_dense(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The average of a dense part; with a share group, this rank exchanges its slice
        and the node all-gathers the slices (equal lengths, the last one padded)."""
        if self.share is None:
            return self.exchange.average(flat, name)
        n, parts, me = flat.numel(), self.share.size(), self.share.rank()
        size = -(-n // parts)
        size = -(-size // BLOCK_ALIGN) * BLOCK_ALIGN
        lo, hi = min(me * size, n), min((me + 1) * size, n)
        mine = torch.zeros(size, dtype=torch.float32, device=flat.device)
        if hi > lo:  # the same on the whole outer group: its ranks hold the same slice
            mine[: hi - lo] = self.exchange.average(flat[lo:hi].contiguous(), name)
        slices = [torch.empty_like(mine) for _ in range(parts)]
        t0 = time.perf_counter()
        dist.all_gather(slices, mine, group=self.share)
        moved = 4 * size * (parts - 1)
        stats.record("outer_node.allgather", moved, moved, time.perf_counter() - t0)
        return torch.cat(slices)[:n]

    def _resolve(self) -> tuple[_Pending, float]:
        """Wait for the pending exchange; returns it and the seconds spent waiting."""
        pending = self._pending
        assert pending is not None
        t0 = time.perf_counter()
        if pending.thread is not None:
            pending.thread.join()
            pending.thread = None
        if pending.error is not None:
            raise RuntimeError(f"outer exchange of fragment {pending.fragment} (started at inner "
                               f"step {pending.started}) failed: {pending.error}") from pending.error
        return pending, time.perf_counter() - t0

    def _finish(self, t: int, mix: bool = True) -> None:
        """Apply the pending exchange: the outer Nesterov step from theta_sync, then the
        parameters move there (mixed with their local value by alpha when ``mix``)."""
        pending, waited = self._resolve()
        avg = pending.average
        assert avg is not None
        frag = self._frags[pending.fragment]
        alpha = self.alpha if mix else 0.0
        if pending.started != t:  # the parameters moved while the exchange was in flight
            self._inner_sync()
        # Plain products, not add(alpha=): torch fuses those into FMAs, whose rounding
        # differs from the formula m = mu*m + avg, theta -= lr*(avg + mu*m) written out.
        buf = frag.momentum
        buf.mul_(self.momentum).add_(avg)
        update = avg + buf * self.momentum if self.nesterov else buf
        frag.sync.sub_(update * self.lr)
        for pc, held, new in zip(frag.pieces, frag.locals(), frag.views(frag.sync), strict=True):
            if alpha == 0.0:
                held.copy_(new)
            else:
                held.copy_(torch.lerp(new, held.float(), alpha))
            anchor = self.inner.state.get(pc.param, {}).get("anchor")
            if anchor is not None:  # 0/1 Adam's local steps restart from the new point
                flat_view(anchor)[pc.lo:pc.hi].copy_(held)
        self._pending = None
        self.sync_count += 1
        self.last_sync = SyncRecord(t, pending.started, pending.fragment, pending.local_norm,
                                    float(avg.norm()), pending.seconds, waited,
                                    pending.bytes_sent)

    def _inner_sync(self) -> None:
        """0/1 Adam's replicas drift within the inner group between its own syncs: agree
        first, so that every member of the node sends and receives the same thing."""
        sync = getattr(self.inner, "synchronize", None)
        if callable(sync):
            sync()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state: an in-flight exchange is waited for and its average saved,
        so a resume applies it at the same step as the straight run (every rank of the outer
        group must save at the same step, as a checkpoint does)."""
        pending = None
        if self._pending is not None:
            p, _ = self._resolve()
            pending = {"fragment": p.fragment, "started": p.started, "due": p.due,
                       "local_norm": p.local_norm, "average": p.average.clone(),
                       "seconds": p.seconds, "bytes_sent": p.bytes_sent}
        return {"outer": {
            "version": 1, "step": self.step_count, "sync_count": self.sync_count,
            "outer_every": self.every, "outer_fragments": self.fragments,
            "outer_delay": self.delay, "outer_compress": self.compress,
            "numels": [f.sync.numel() for f in self._frags],
            "sync": [f.sync.clone() for f in self._frags],
            "momentum": [f.momentum.clone() for f in self._frags],
            "exchange": self.exchange.state_dict(), "pending": pending,
        }}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` saved by this rank with the same schedule and layout.

        ``outer_lr``, ``outer_momentum``, ``outer_nesterov`` and ``outer_alpha`` are this
        object's own (they may change on resume); the schedule keys must match.
        """
        s = state.get("outer")
        if not isinstance(s, dict) or s.get("version") != 1:
            raise ValueError("not an outer optimizer state_dict (no 'outer' section of version 1)")
        mine = {"outer_every": self.every, "outer_fragments": self.fragments,
                "outer_delay": self.delay, "outer_compress": self.compress}
        for key, value in mine.items():
            if s.get(key) != value:
                raise ValueError(f"outer optimizer state has {key}={s.get(key)!r}, this run "
                                 f"{value!r}: the schedule cannot change mid-run")
        numels = [f.sync.numel() for f in self._frags]
        if list(s["numels"]) != numels:
            raise ValueError(f"outer optimizer state holds fragments of {list(s['numels'])} "
                             f"elements, these parameters {numels}")
        if self._pending is not None:
            self._resolve()
        for f, sync, mom in zip(self._frags, s["sync"], s["momentum"], strict=True):
            f.sync.copy_(sync)
            f.momentum.copy_(mom)
        self.exchange.load_state_dict(s["exchange"])
        self.step_count, self.sync_count = int(s["step"]), int(s["sync_count"])
        p = s["pending"]
        self._pending = None if p is None else _Pending(
            int(p["fragment"]), int(p["started"]), int(p["due"]), float(p["local_norm"]),
            average=p["average"].to(self._frags[0].sync.device).float(),
            seconds=float(p["seconds"]), bytes_sent=int(p["bytes_sent"]))
        self.last_sync = None

    def close(self) -> None:
        """Wait for an exchange still in flight (at the end of a run)."""
        if self._pending is not None and self._pending.thread is not None:
            self._pending.thread.join()

    def state_bytes(self) -> int:
        """Bytes of outer state: theta_sync and the momentum (2 float32 copies of what this
        rank holds: the model, or its shards under FSDP2), plus the 1-bit error buffers."""
        total = sum(2 * 4 * f.sync.numel() for f in self._frags)
        for t in tensors_in(self.exchange.state_dict()):
            total += t.numel() * t.element_size()
        return total


def _outer_bytes() -> int:
    return sum(o.bytes_sent for k, o in stats.snapshot().by_kind().items() if k == "outer")

