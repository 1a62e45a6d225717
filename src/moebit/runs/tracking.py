"""Experiment tracking: the training loop's metric records, also sent to TensorBoard / W&B.

The JSON lines in ``RUN/metrics.jsonl`` stay the source of truth (``moebit report`` reads
only them); trackers are extra views of the same records for people whose tooling is
TensorBoard or Weights & Biases. The loop opens them once on rank 0 and hands every
record it writes to ``log_record``; nothing here knows the loop's internals, so a new
field in a record shows up in TensorBoard without a change here.

    trackers = open_trackers(cfg, run_dir, rank)      # [] unless --tensorboard / --wandb
    log_record(trackers, {"kind": "train", "step": 10, "loss": 2.1, ...})
    close_trackers(trackers)

What a record becomes (``tags_of``): numeric fields are scalars at the record's step,
named ``<group>/<field>``: train records' communication fields under ``comm/``, their MoE
fields under ``moe/``, the rest under ``train/``; other kinds under their kind
(``eval/val_loss``, ``freeze/clipped_frac_before``). ``step_bytes_by_op`` becomes one
scalar per collective, ``comm/step_bytes_sent/<op>``. Per-layer ``expert_load`` becomes
a histogram over expert index per MoE block (``moe/expert_load/block<i>``: the height of
bucket e is the tokens expert e received) and the scalar ``moe/load_max_over_mean/
block<i>`` (1.0 is perfect balance). Events (start, resume, freeze, kd_stop, nan, end) are
also a text entry ``events/<kind>`` and a scalar ``events/<kind>`` = 1 at their step, so
they line up with the curves.
"""

from __future__ import annotations

import html
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

TRACK_EXTRA = "pip install 'moebit[track]'  (or: pip install tensorboard)"
WANDB_EXTRA = "pip install 'moebit[wandb]'  (or: pip install wandb)"

EVENT_KINDS = ("start", "resume", "freeze", "kd_stop", "nan", "end")
_COMM_FIELDS = {"bytes_sent", "bytes_recv", "step_bytes_sent", "step_bytes_recv",
                "comm_seconds_per_step", "collectives", "comm_rounds"}
_MOE_FIELDS = {"aux_loss", "drop_rate"}
_NOT_SCALARS = {"kind", "step", "expert_load", "step_bytes_by_op", "samples"}


class TrackingUnavailable(RuntimeError):
    """A tracker was asked for but its package is not installed; the message says how to."""


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- records


@dataclass
class Tags:
    """What one record becomes, independent of the tracker that writes it."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    loads: dict[str, list[int]] = field(default_factory=dict)  # histogram tag -> per-expert
    text: dict[str, str] = field(default_factory=dict)


def _group(kind: str, key: str) -> str:
    if kind != "train":
        return kind
    if key in _COMM_FIELDS:
        return "comm"
    if key in _MOE_FIELDS:
        return "moe"
    return "train"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _event_text(rec: dict[str, Any]) -> str:
    """One readable line per field (markdown: TensorBoard renders it)."""
    lines = []
    for k, v in rec.items():
        if k in ("kind", "samples"):
            continue
        shown = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
        lines.append(f"- **{k}**: {shown}")
    for s in rec.get("samples") or []:
        lines.append("\n    " + str(s).replace("\n", "\n    "))
    return "\n".join(lines)


def tags_of(rec: dict[str, Any]) -> Tags:
    """The scalars, histograms and text of one metrics record (any kind, any fields)."""
    if not isinstance(rec, dict):
        raise TypeError(f"a metrics record must be a dict, got {type(rec).__name__}")
    kind = str(rec.get("kind", "record"))
    step = rec.get("step", rec.get("steps", 0)) if kind != "start" else 0
    out = Tags(step=int(step) if _is_number(step) else 0)
    for k, v in rec.items():
        if k not in _NOT_SCALARS and _is_number(v):
            out.scalars[f"{_group(kind, k)}/{k}"] = float(v)
    for op, v in (rec.get("step_bytes_by_op") or {}).items():
        if _is_number(v):
            out.scalars[f"comm/step_bytes_sent/{op}"] = float(v)
    for i, load in enumerate(rec.get("expert_load") or []):
        counts = [int(c) for c in load]
        out.loads[f"moe/expert_load/block{i}"] = counts
        mean = sum(counts) / max(1, len(counts))
        if mean > 0:
            out.scalars[f"moe/load_max_over_mean/block{i}"] = max(counts) / mean
    if kind in EVENT_KINDS:
        out.scalars[f"events/{kind}"] = 1.0
        out.text[f"events/{kind}"] = _event_text(rec)
    return out


# ----------------------------------------------------------------------------- trackers


class TensorBoardTracker:
    """Event files in ``RUN/tensorboard`` (``tensorboard --logdir RUN``).

    The writer opens at the first record: when that is a ``resume`` record, TensorBoard is
    told to drop the earlier session's events from the resumed step on (``purge_step``),
    as ``metrics.jsonl`` is trimmed back to the checkpoint, so no step shows twice.
    """

    def __init__(self, log_dir: Path) -> None:
        try:  # optional extra: imported only when --tensorboard asks for it
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackingUnavailable(
                f"--tensorboard needs the 'tensorboard' package, which is not installed "
                f"({e}); install it with: {TRACK_EXTRA}"
            ) from None
        self.log_dir = log_dir
        self._writer_cls = SummaryWriter
        self.writer: Any = None

    def _open(self, record: dict[str, Any]) -> Any:
        if self.writer is None:
            purge = record.get("step") if record.get("kind") == "resume" else None
            self.writer = self._writer_cls(log_dir=str(self.log_dir), flush_secs=10,
                                           purge_step=purge)
        return self.writer

    def log(self, record: dict[str, Any]) -> None:
        self._open(record)
        t = tags_of(record)
        for tag, v in t.scalars.items():
            self.writer.add_scalar(tag, v, t.step)
        for tag, counts in t.loads.items():
            _add_load_histogram(self.writer, tag, counts, t.step)
        for tag, text in t.text.items():
            self.writer.add_text(tag, text, t.step)
        if record.get("kind") in EVENT_KINDS:
            self.writer.flush()  # events are rare and are what one looks for after a crash

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _add_load_histogram(writer: Any, tag: str, counts: list[int], step: int) -> None:
    """A histogram over expert index whose bucket e holds expert e's tokens.

    A histogram of the counts themselves would lose which expert is hot; this way
    TensorBoard's histogram view shows the load per expert drifting over steps.
    """
    total = sum(counts)
    if total == 0:
        return
    idx = range(len(counts))
    writer.add_histogram_raw(
        tag, min=float(min(i for i in idx if counts[i])), max=float(max(i for i in idx if counts[i])),
        num=total, sum=float(sum(i * c for i, c in zip(idx, counts, strict=True))),
        sum_squares=float(sum(i * i * c for i, c in zip(idx, counts, strict=True))),
        bucket_limits=[i + 0.5 for i in idx], bucket_counts=counts, global_step=step,
    )


class WandbTracker:
    """A Weights & Biases run in offline mode, in ``RUN/wandb`` (``wandb sync`` uploads it)."""

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        try:  # optional extra: imported only when --wandb asks for it
            import wandb
        except ImportError as e:
            raise TrackingUnavailable(
                f"--wandb needs the 'wandb' package, which is not installed ({e}); "
                f"install it with: {WANDB_EXTRA}"
            ) from None
        self.wandb = wandb
        self.run = wandb.init(project="moebit", name=run_dir.name, dir=str(run_dir),
                              mode="offline", config=config)
        self._last_step = 0

    def log(self, record: dict[str, Any]) -> None:
        t = tags_of(record)
        step = max(t.step, self._last_step)  # W&B drops rows whose step goes back
        self._last_step = step
        row: dict[str, Any] = dict(t.scalars)
        for tag, counts in t.loads.items():
            edges = [i - 0.5 for i in range(len(counts) + 1)]
            row[tag] = self.wandb.Histogram(np_histogram=(counts, edges))
        for tag, text in t.text.items():  # beside the event's scalar of the same tag
            row[f"{tag}/text"] = self.wandb.Html(f"<pre>{html.escape(text)}</pre>")
        if row:
            self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()


# ----------------------------------------------------------------------------- the loop's API


def wanted(cfg: Any) -> tuple[bool, bool]:
    """(tensorboard, wandb) as the config asks; configs without the fields ask for neither."""
    return bool(getattr(cfg, "tensorboard", False)), bool(getattr(cfg, "wandb", False))


def require(cfg: Any) -> None:
    """Fail before any rank starts when an asked-for tracker's package is missing."""
    tb, wb = wanted(cfg)
    if tb and importlib.util.find_spec("tensorboard") is None:
        raise TrackingUnavailable(f"--tensorboard needs the 'tensorboard' package, which is "
                                  f"not installed; install it with: {TRACK_EXTRA}")
    if wb and importlib.util.find_spec("wandb") is None:
        raise TrackingUnavailable(f"--wandb needs the 'wandb' package, which is not "
                                  f"installed; install it with: {WANDB_EXTRA}")


def open_trackers(cfg: Any, run_dir: Path, rank: int = 0) -> list[Tracker]:
    """The trackers ``cfg`` asks for (``tensorboard`` / ``wandb`` fields); [] off rank 0.

    Only rank 0 writes: its records are the ones ``metrics.jsonl`` keeps, and N writers
    would make N runs in the dashboard.
    """
    tb, wb = wanted(cfg)
    if rank != 0 or not (tb or wb):
        return []
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    try:
        if tb:
            trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
        if wb:
            conf = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
            trackers.append(WandbTracker(run_dir, conf))
    except BaseException:
        close_trackers(trackers)
        raise
    return trackers


def log_record(trackers: list[Tracker], record: dict[str, Any]) -> None:
    for t in trackers:
        t.log(record)


def close_trackers(trackers: list[Tracker]) -> None:
    for t in trackers:
        t.close()
