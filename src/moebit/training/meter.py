"""What the training loop measures: a window of steps per ``train`` record, and run totals.

The totals (bytes, collectives, training time, skipped steps, tokens, ...) are counted over
the whole run, every attempt of it: the checkpoint's train state carries them, so the
``end`` record of a resumed or restarted run reports the run, not only its last attempt.
Communication is counted from the start of this attempt's loop (``comm.stats`` is
per-process), so runs that share a process do not add up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from moebit.comm import stats
from moebit.moe import router_metrics
from moebit.optim.outer import SyncRecord


@dataclass
class RunTotals:
    """Whole-run counters; saved with every checkpoint and restored on resume."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    collectives: int = 0
    train_time: float = 0.0  # seconds inside training steps (evaluation and saving excluded)
    steps_trained: int = 0  # optimizer steps taken (skipped steps excluded)
    tokens: int = 0  # tokens of the steps taken, over all ranks
    clipped_steps: int = 0
    nan_skipped: int = 0
    bytes_sent_by_kind: dict[str, int] = field(default_factory=dict)  # token a2a, exact, 1-bit...
    outer_syncs: int = 0  # outer updates applied (one per fragment sync)
    outer_seconds: float = 0.0  # in the outer exchanges (in the background with a delay)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RunTotals:
        """Counters of a checkpoint; one written before they existed starts them at 0."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})


@dataclass
class Window:
    """Sums over the steps since the last ``train`` record."""

    n: int = 0
    time: float = 0.0
    loss: float = 0.0
    aux: float = 0.0
    norm: float = 0.0
    clipped: int = 0
    extra: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, steps]
    syncs: list[SyncRecord] = field(default_factory=list)  # outer syncs finished in the window

    def outer_means(self) -> dict[str, float]:
        """The outer syncs of the window: how many, and per sync the mean pseudo-gradient
        norms (this rank's and the exchanged average's), exchange and waiting seconds."""
        n = len(self.syncs)
        if not n:
            return {}
        out: dict[str, float] = {"outer_syncs": n}
        for key in ("pseudo_grad_norm", "mean_pseudo_grad_norm", "seconds", "wait_seconds"):
            out[f"outer_{key}"] = sum(getattr(r, key) for r in self.syncs) / n
        return out

    def means(self) -> dict[str, float]:
        """The hooks' metrics, each averaged over the steps that reported it."""
        return {k: s / c for k, (s, c) in self.extra.items() if c}


def moe_metrics(ffn_outputs: list[Any]) -> dict[str, Any]:
    """Drop rate and expert load of the MoE blocks of one forward pass."""
    out: dict[str, Any] = {}
    loads, drops = [], []
    for o in ffn_outputs:
        st = getattr(o, "stats", None)
        if st is None:
            continue
        loads.append([int(v) for v in st.tokens_per_expert.tolist()])
        drops.append(float(st.fraction_dropped))
    if loads:
        out["drop_rate"] = sum(drops) / len(drops)
        out["expert_load"] = loads
        out.update(router_metrics([o.stats for o in ffn_outputs
                                   if getattr(o, "stats", None) is not None]))  # max/mean load, biases
    return out


class Meter:
    """Counts steps into the window and the run totals, and writes them as records."""

    def __init__(self, tokens_per_step: int, totals: RunTotals, is_moe: bool,
                 origin: stats.CommStats) -> None:
        self.tokens_per_step = tokens_per_step
        self.saved = totals  # what earlier attempts counted
        self.is_moe = is_moe
        self.origin = origin  # this attempt's communication counts from this snapshot
        self.win, self.win_stats = Window(), self.origin
        self.last_moe: dict[str, Any] = {}
        self.train_time = totals.train_time
        self.steps_trained, self.tokens = totals.steps_trained, totals.tokens
        self.clipped_steps, self.nan_skipped = totals.clipped_steps, totals.nan_skipped
        self.outer_syncs, self.outer_seconds = totals.outer_syncs, totals.outer_seconds

    def outer_sync(self, rec: SyncRecord) -> None:
        """An outer sync finished at this step (``OuterOptimizer.step``'s record)."""
        self.win.syncs.append(rec)
        self.outer_syncs += 1
        self.outer_seconds += rec.seconds

    def step(self, seconds: float, loss: float, aux: float, norm: float, clipped: bool,
             extra: dict[str, float], ffn_outputs: list[Any]) -> None:
        """A step that reached the optimizer."""
        w = self.win
        w.n += 1
        w.time += seconds
        w.loss += loss
        w.aux += aux
        w.norm += norm
        w.clipped += int(clipped)
        for k, v in extra.items():
            s = w.extra.setdefault(k, [0.0, 0])
            s[0] += v
            s[1] += 1
        self.train_time += seconds
        self.steps_trained += 1
        self.tokens += self.tokens_per_step
        self.clipped_steps += int(clipped)
        if self.is_moe:
            self.last_moe = moe_metrics(ffn_outputs)

    def totals(self) -> RunTotals:
        """The whole run's counters up to now (earlier attempts included)."""
        d = stats.snapshot().minus(self.origin)
        s = self.saved
        kinds = dict(s.bytes_sent_by_kind)
        for k, o in d.by_kind().items():
            kinds[k] = kinds.get(k, 0) + o.bytes_sent
        return RunTotals(
            bytes_sent=s.bytes_sent + d.bytes_sent, bytes_recv=s.bytes_recv + d.bytes_recv,
            collectives=s.collectives + d.calls, train_time=self.train_time,
            steps_trained=self.steps_trained, tokens=self.tokens,
            clipped_steps=self.clipped_steps, nan_skipped=self.nan_skipped,
            bytes_sent_by_kind=kinds, outer_syncs=self.outer_syncs,
            outer_seconds=self.outer_seconds)

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.train_time, 1e-9)

    def train_record(self, step: int, lr: float, wall: float, opt: torch.optim.Optimizer
                     ) -> dict[str, Any]:
        """The ``train`` record of the window ending at ``step``; starts the next window."""
        now = stats.snapshot()
        d, w, n = now.minus(self.win_stats), self.win, self.win.n
        t = self.totals()
        rec = {
            "kind": "train", "step": step, "loss": w.loss / n, "lr": lr,
            "tokens_per_s": self.tokens_per_step * n / max(w.time, 1e-9),
            "bytes_sent": t.bytes_sent, "bytes_recv": t.bytes_recv,
            "step_bytes_sent": d.bytes_sent / n, "step_bytes_recv": d.bytes_recv / n,
            "comm_seconds_per_step": sum(o.seconds for o in d.ops.values()) / n,
            "wall": wall, "train_time": self.train_time,
            "comm_stage": getattr(opt, "comm_stage", "exact"),
            "collectives": d.calls,
            "step_bytes_by_op": {k: o.bytes_sent / n for k, o in d.ops.items() if o.bytes_sent},
            **stats.per_step_by_kind(d, n),
            # Before clipping; the norm of the average while gradients are averaged
            # exactly, of this rank's own gradient once a compressed optimizer froze.
            "grad_norm": w.norm / n, "clipped_frac": w.clipped / n,
        }
        if hasattr(opt, "comm_rounds"):
            rec["comm_rounds"] = opt.comm_rounds
        rec.update(w.means())
        rec.update(w.outer_means())
        if self.is_moe:
            rec["aux_loss"] = w.aux / n
            rec.update(self.last_moe)
        self.win, self.win_stats = Window(), now
        return rec
