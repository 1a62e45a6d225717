"""Bytes on the wire and time per collective, counted by this process.

Every collective that moebit issues records what it put on and took off the
network, so training metrics and benchmarks can show the saving of compression
without packet capture. Counts are the algorithmic volume of the collective
(a ring allreduce of n bytes sends 2·(W-1)/W·n), which is what gloo and NCCL
move for large messages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class OpStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0


@dataclass
class CommStats:
    """A snapshot: totals plus a per-operation breakdown."""

    ops: dict[str, OpStats] = field(default_factory=dict)

    @property
    def bytes_sent(self) -> int:
        return sum(o.bytes_sent for o in self.ops.values())

    @property
    def bytes_recv(self) -> int:
        return sum(o.bytes_recv for o in self.ops.values())

    @property
    def calls(self) -> int:
        return sum(o.calls for o in self.ops.values())

    def minus(self, earlier: CommStats) -> CommStats:
        """What happened between ``earlier`` and this snapshot."""
        out: dict[str, OpStats] = {}
        for name, o in self.ops.items():
            e = earlier.ops.get(name, OpStats())
            out[name] = OpStats(
                o.calls - e.calls,
                o.bytes_sent - e.bytes_sent,
                o.bytes_recv - e.bytes_recv,
                o.seconds - e.seconds,
            )
        return CommStats(out)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {k: vars(v).copy() for k, v in self.ops.items()}

    def by_kind(self) -> dict[str, OpStats]:
        """The operations summed per ``kind_of`` (token all-to-all, exact, 1-bit, other)."""
        out: dict[str, OpStats] = {}
        for name, o in self.ops.items():
            k = out.setdefault(kind_of(name), OpStats())
            k.calls += o.calls
            k.bytes_sent += o.bytes_sent
            k.bytes_recv += o.bytes_recv
            k.seconds += o.seconds
        return out


KINDS = ("a2a", "exact", "onebit", "outer", "outer_node", "ddp_hook", "rs", "ag", "other")


def kind_of(op: str) -> str:
    """Which kind of traffic an operation name is, for per-kind bytes and time.

    ``a2a``: the MoE token all-to-all (dispatch, combine, their split sizes); ``onebit``: the
    compressed optimizer exchanges; ``outer``: DiLoCo's pseudo-gradient exchanges
    (``moebit.optim.outer``, every compression: fp32, bf16, int8, 1-bit), kept apart because
    they happen once per H steps; ``outer_node``: the all-gather inside a node that
    completes them when the node's ranks each exchanged a slice; ``exact``: full-precision
    gradient or optimizer-state averages (plain allreduces, 1-bit Adam's warm-up, DDP); ``ddp_hook``: torch's
    compressing DDP hooks run as benchmark peers (PowerSGD, fp16); ``rs`` / ``ag``: sharded
    training's gradient reduce-scatters and parameter all-gathers (``fsdp.rs.*``,
    ``fsdp.ag.*``, exact or compressed); ``other``: small control collectives (NaN
    verdict, freeze check).
    """
    if op.startswith("moe.all_to_all"):
        return "a2a"
    if op.startswith("outer."):
        return "outer"
    if op.startswith("outer_node."):
        return "outer_node"
    if op.startswith("fsdp.rs."):
        return "rs"
    if op.startswith("fsdp.ag."):
        return "ag"
    if op.startswith("onebit."):
        return "onebit"
    if op in ("ddp.powersgd", "ddp.fp16"):
        return "ddp_hook"
    if "allreduce" in op or op.endswith((".warmup", ".var")):
        return "exact"
    return "other"


_lock = threading.Lock()
_ops: dict[str, OpStats] = {}


def record(op: str, bytes_sent: int, bytes_recv: int, seconds: float = 0.0) -> None:
    """Add one collective's traffic under the name ``op``."""
    with _lock:
        s = _ops.setdefault(op, OpStats())
        s.calls += 1
        s.bytes_sent += int(bytes_sent)
        s.bytes_recv += int(bytes_recv)
        s.seconds += float(seconds)


def add_time(op: str, seconds: float) -> None:
    """Add time to ``op`` without counting a call (for phases such as packing)."""
    with _lock:
        _ops.setdefault(op, OpStats()).seconds += float(seconds)


@contextmanager
def timed(op: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add_time(op, time.perf_counter() - t0)


def per_step_by_kind(window: CommStats, steps: int) -> dict[str, dict[str, float]]:
    """Metrics fields for a window of ``steps`` steps: bytes sent and seconds per step, per
    kind (``{"step_bytes_by_kind": {"a2a": ...}, "comm_seconds_by_kind": {...}}``)."""
    kinds = window.by_kind()
    n = max(1, steps)
    return {"step_bytes_by_kind": {k: o.bytes_sent / n for k, o in kinds.items()},
            "comm_seconds_by_kind": {k: o.seconds / n for k, o in kinds.items()}}


def snapshot() -> CommStats:
    with _lock:
        return CommStats({k: OpStats(**vars(v)) for k, v in _ops.items()})


def reset() -> None:
    with _lock:
        _ops.clear()


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends (and receives) in a ring allreduce of ``nbytes``."""
    return 0 if world <= 1 else (2 * (world - 1) * nbytes) // world
