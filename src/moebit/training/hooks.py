"""How a kind of training plugs into the one loop (``moebit.training.loop.train``): ``Hooks``.

Plain training passes no hooks. Mixture-of-Students (``moebit.distill.run``) passes a KD stage:
an extra loss term (the teacher's forward and the KD loss), a stop rule run before each
step, extra fields for the start/eval/end records, and its own state, saved in every
checkpoint so that the stage survives a resume. Every field is optional; a hook receives
the ``Loop`` (the run's objects and its record writer) where it needs more than its
arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moebit.comm.collectives import DistInfo
from moebit.models.interface import ModelOutput
from moebit.training.config import TrainConfig
from moebit.training.evaluation import evaluate

Batch = tuple[torch.Tensor, torch.Tensor]  # (input_ids, targets), [B, T] each, on the device
Record = dict[str, Any]


@dataclass
class Loop:
    """What hooks may use: the run's objects, its validation batches and its record writer."""

    cfg: TrainConfig
    info: DistInfo
    model: nn.Module
    opt: torch.optim.Optimizer
    val_batches: list[Batch]
    emit: Callable[[Record], None]  # writes one metrics record (rank 0; a no-op elsewhere)

    def validate(self) -> float:
        """The model's validation loss (a collective with expert parallelism: every rank
        must call it at the same step)."""
        return evaluate(self.model, self.val_batches, self.cfg.dtype, self.info.device)


def _nothing(*args: Any) -> None:
    return None


def is_nothing(fn: Callable[..., Any]) -> bool:
    """Whether a hook is the default no-op (``build_run_model``: the built model is kept)."""
    return fn is _nothing


def _no_fields(*args: Any) -> Record:
    return {}


@dataclass
class Hooks:
    """Additions to the loop, no-ops by default; each is called on every rank.

    - ``init_model(model)``: after the model is built, before it is broadcast, restored or
      trained (e.g. a student copied from its teacher).
    - ``start(loop) -> fields``: a fresh run only, added to its ``start`` record.
    - ``before_step(loop, step)``: the stage/stop rule, before 0-based step ``step``
      (``step`` steps are done); it may validate and emit records.
    - ``extra_loss(batch, out) -> (loss, metrics) | None``: a term added to LM + aux loss
      before backward; its metrics are averaged into ``train`` records over the steps
      that reported them. None: no extra term this step.
    - ``evaluated(loop, step, val_loss) -> fields``: added to each ``eval`` record.
    - ``end(loop, summary) -> fields``: added to the ``end`` record.
    - ``state_dict() -> dict`` / ``load_state_dict(d)``: the hooks' own state, saved in
      every checkpoint (torch.save-able, loaded with weights_only) and restored on resume.
    """

    label: str = "train"  # the progress bar's name
    init_model: Callable[[nn.Module], None] = _nothing
    start: Callable[[Loop], Record] = _no_fields
    before_step: Callable[[Loop, int], None] = _nothing
    extra_loss: Callable[[Batch, ModelOutput], tuple[torch.Tensor, dict[str, float]] | None] = _nothing
    evaluated: Callable[[Loop, int, float], Record] = _no_fields
    end: Callable[[Loop, Record], Record] = _no_fields
    state_dict: Callable[[], dict[str, Any]] = _no_fields
    load_state_dict: Callable[[dict[str, Any]], None] = _nothing
