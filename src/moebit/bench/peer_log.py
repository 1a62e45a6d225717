"""The metrics records of a peer bench run (``ddp_peer``, ``torchft_peer``): ``train``
windows, ``eval`` and ``end`` records shaped like ``moebit train``'s, so that the bench
reads a peer's run folder as it reads moebit's. One writer, so that both peers count
tokens, bytes and time the same way."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moebit.comm import stats
from moebit.training.config import TrainConfig


class PeerLog:
    """RUN/metrics.jsonl of one peer run, written by the main rank only (the other ranks
    keep the same windows and evaluate alike, so the collectives match, but write nothing)."""

    def __init__(self, run_dir: Path, main: bool, cfg: TrainConfig, world_size: int,
                 evaluate: Callable[[], float]) -> None:
        self._file = (run_dir / "metrics.jsonl").open("a") if main else None
        self._cfg, self._evaluate = cfg, evaluate
        self._tokens_per_step = cfg.batch_size * cfg.model.block_size * world_size
        self.train_time, self.val_loss = 0.0, math.nan
        self._restart_window()
        self._t_start = time.perf_counter()

    def _restart_window(self, snap: stats.CommStats | None = None) -> None:
        self._win_time, self._win_loss, self._win_n = 0.0, 0.0, 0
        self._win_stats = stats.snapshot() if snap is None else snap

    def emit(self, rec: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def start(self, rec: dict[str, Any]) -> None:
        """The ``start`` record; the clock and the first window start after it."""
        self.emit({"kind": "start", **rec})
        self._t_start = time.perf_counter()
        self._restart_window()

    def step(self, step: int, loss: float, seconds: float) -> None:
        """Step ``step`` (0-based) took ``seconds`` at ``loss``: a ``train`` record every
        log_every steps and at the last, an ``eval`` one every eval_every and at the last."""
        cfg = self._cfg
        self.train_time += seconds
        self._win_time, self._win_loss, self._win_n = (self._win_time + seconds,
                                                       self._win_loss + loss, self._win_n + 1)
        last = step == cfg.steps - 1
        if (step + 1) % cfg.log_every == 0 or last:
            now = stats.snapshot()
            d, n = now.minus(self._win_stats), self._win_n
            self.emit({"kind": "train", "step": step + 1, "loss": self._win_loss / n,
                       "tokens_per_s": self._tokens_per_step * n / self._win_time,
                       "bytes_sent": now.bytes_sent, "step_bytes_sent": d.bytes_sent / n,
                       "comm_seconds_per_step": None,  # a peer waits inside its own hooks
                       "wall": time.perf_counter() - self._t_start, "train_time": self.train_time,
                       **stats.per_step_by_kind(d, n)})
            self._restart_window(now)
        if (step + 1) % cfg.eval_every == 0 or last:
            self.val_loss = self._evaluate()
            self.emit({"kind": "eval", "step": step + 1, "val_loss": self.val_loss,
                       "wall": time.perf_counter() - self._t_start, "train_time": self.train_time})

    def end(self) -> None:
        """The ``end`` record (totals of the whole run), then the file is closed."""
        total = stats.snapshot()
        self.emit({"kind": "end", "steps": self._cfg.steps, "val_loss": self.val_loss,
                   "train_time": self.train_time, "wall": time.perf_counter() - self._t_start,
                   "bytes_sent": total.bytes_sent,
                   "tokens_per_s": self._tokens_per_step * self._cfg.steps
                   / max(self.train_time, 1e-9), "frozen_at": None,
                   "bytes_sent_by_kind": {k: o.bytes_sent for k, o in total.by_kind().items()}})
        if self._file is not None:
            self._file.close()
            self._file = None
