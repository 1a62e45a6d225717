"""When to freeze Adam's variance: the ``freeze_step="auto"`` rule of 1-bit Adam.

1-bit Adam may only stop exchanging exact gradients once its preconditioner
sqrt(v̂) has stopped moving: after the freeze v̂ is never updated again, so freezing
while it still drifts bakes a wrong per-coordinate step size into the rest of the run.
DeepSpeed leaves the choice to the user (a step count, "15-25% of the run"), which needs
the run length in advance and is wrong for a resumed or extended run. This rule watches
the preconditioner itself.

The rule. Every ``window`` steps (after ``min_steps``) compare the bias-corrected
preconditioner with its snapshot from one window earlier:

    drift = Σ |sqrt(v̂_t) - sqrt(v̂_{t-window})|  /  Σ sqrt(v̂_t)

and freeze once ``drift < threshold`` on ``patience`` consecutive checks (or at
``max_steps`` if that comes first). A check at which the learning rate has grown since
the previous one never counts as quiet: v seen during a learning-rate warm-up (small,
growing updates of a model still near its initialization) is not the v of the run.
Why these choices:

- sqrt(v̂) is what divides the update, so its relative change is the relative change of
  the per-coordinate step size. The L1 sum weights every coordinate by its own scale;
  an L2 norm of v (squared gradients) would be decided by the few coordinates with the
  largest gradients (embeddings of frequent tokens, biases).
- v̂ is an EMA with time constant 1/(1-β2) (1000 steps for β2=0.999). While t is small
  it is the plain mean of all past g², so a window moves it by about (window/t)·|1-r|/2,
  r being the ratio of recent to past g²: the rule freezes early when gradient scale is
  steady (r≈1), waits until about t = window·|1-r|/(2·threshold) (up to 250 steps with
  the defaults) while gradients shrink, and longer while they grow (r > 1, the dangerous
  direction: a frozen v that is too small means too large steps). Its noise floor with
  steady gradients is about sqrt(2·window)/(2t), far below the default threshold.
- ``patience`` guards against one quiet window inside a drifting phase.
- Past t ≈ 1/(1-β2) the EMA's horizon bounds the drift by about window·(1-β2)·|1-r|/2,
  so the rule freezes by step ~1000 (β2=0.999, defaults) unless gradients still grow
  5-fold: the freeze step does not depend on the run length; ``min_steps`` (e.g.
  15% of a known run length) and ``max_steps`` bound it from outside.
- Measured (``python -m moebit.bench.freeze``, docs/optimizers.md, two seeds): on a
  byte-level LM, drift ≈ 0.4·window/t; a fixed freeze at 5% of 1200 steps (drift ~0.4)
  cost 5-8% of validation loss, at 10% (drift ~0.25) about 1%, from 20% on nothing; the
  default threshold 0.1 froze at step 300 (25%) on both seeds, as good as Adam with
  3.7x fewer bytes.

Every rank must take the same decision (a mismatch hangs the collectives of the two
stages). In warm-up, gradients are averaged over each group, so v is identical on the
ranks of a group; groups with different process groups (expert parameters) hold
different v on different ranks, so the two sums are all-reduced over the optimizer's
process group before they are compared: identical inputs, identical decision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moebit.comm import collectives, stats

logger = logging.getLogger("moebit.optim")

_CHUNK = 1 << 18  # elements per temporary (1 MiB of fp32)


@dataclass
class AutoFreeze:
    """The variance-stability rule; ``observe`` is called once per warm-up step.

    Defaults were chosen with ``python -m moebit.bench.freeze`` (docs/optimizers.md): a
    threshold 2.5x below the drift at the earliest harmless fixed freeze measured there.
    """

    window: int = 50
    threshold: float = 0.1
    patience: int = 2
    min_steps: int = 100
    max_steps: int | None = None
    # Mutable state (saved in the optimizer's state_dict).
    snapshot: list[torch.Tensor] | None = field(default=None, repr=False)
    snapshot_step: int = 0
    quiet_checks: int = 0
    last_drift: float | None = None
    last_lr: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"auto freeze window must be an int >= 1, got {self.window!r}")
        if not (self.threshold > 0):
            raise ValueError(f"auto freeze threshold must be > 0, got {self.threshold!r}")
        if not (isinstance(self.patience, int) and self.patience >= 1):
            raise ValueError(f"auto freeze patience must be an int >= 1, got {self.patience!r}")
        if not (isinstance(self.min_steps, int) and self.min_steps >= 1):
            raise ValueError(f"auto freeze min_steps must be an int >= 1, got {self.min_steps!r}")
        if self.max_steps is not None and not (
            isinstance(self.max_steps, int) and self.max_steps >= self.min_steps
        ):
            raise ValueError(
                f"auto freeze max_steps must be None or an int >= min_steps, got {self.max_steps!r}"
            )

    def observe(
        self,
        step: int,
        exp_avg_sqs: list[torch.Tensor],
        bias_correction2: float,
        group: dist.ProcessGroup | None = None,
        lr: float | None = None,
    ) -> bool:
        """Look at v after warm-up step ``step``; True when the variance should freeze now.

        ``exp_avg_sqs`` are the raw (uncorrected) second-moment buffers; the snapshot is
        only taken from ``min_steps - window`` on, so it costs no memory before then.
        ``lr``: the current learning rate; a check at which it has grown since the last
        one (a learning-rate warm-up still running) never counts as quiet.
        """
        if self.max_steps is not None and step >= self.max_steps:
            return True
        if step < self.min_steps - self.window or step % self.window != 0:
            return False
        scale = 1.0 / bias_correction2
        compare = self.snapshot is not None and step - self.snapshot_step == self.window
        if self.snapshot is None or [t.shape for t in self.snapshot] != [
            v.shape for v in exp_avg_sqs
        ]:
            self.snapshot = [torch.empty_like(v) for v in exp_avg_sqs]
            compare = False
        device = exp_avg_sqs[0].device
        moved = torch.zeros((), dtype=torch.float64, device=device)
        total = torch.zeros((), dtype=torch.float64, device=device)
        # Chunk by chunk, overwriting the snapshot in place: no model-sized temporaries.
        for v, snap in zip(exp_avg_sqs, self.snapshot, strict=True):
            for vc, sc in zip(v.reshape(-1).split(_CHUNK), snap.view(-1).split(_CHUNK),
                              strict=True):
                root = vc.mul(scale).sqrt_()
                if compare:
                    moved += (root - sc).abs_().sum(dtype=torch.float64)
                    total += root.sum(dtype=torch.float64)
                sc.copy_(root)
        decided = False
        if compare:
            rising = float(lr is not None and self.last_lr is not None and lr > self.last_lr)
            sums = _sum_over(
                torch.stack([moved.cpu(), total.cpu(), torch.tensor(rising, dtype=torch.float64)]),
                group,
                device,
            )
            drift = float(sums[0] / sums[1].clamp_min(1e-300))
            self.last_drift = drift
            if step >= self.min_steps:
                quiet = drift < self.threshold and float(sums[2]) == 0.0
                self.quiet_checks = self.quiet_checks + 1 if quiet else 0
                decided = self.quiet_checks >= self.patience
            logger.debug("auto freeze check at step %d: drift %.4g", step, drift)
        if decided:
            self.snapshot = None
        self.snapshot_step = step
        self.last_lr = lr
        return decided

    def release(self) -> None:
        """Drop the snapshot (at the freeze: the compression stage does not need it)."""
        self.snapshot = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": {
                "window": self.window,
                "threshold": self.threshold,
                "patience": self.patience,
                "min_steps": self.min_steps,
                "max_steps": self.max_steps,
            },
            "snapshot": None if self.snapshot is None else [t.clone() for t in self.snapshot],
            "snapshot_step": self.snapshot_step,
            "quiet_checks": self.quiet_checks,
            "last_drift": self.last_drift,
            "last_lr": self.last_lr,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore progress; the thresholds of the running optimizer are kept."""
        snap = sd.get("snapshot")
        self.snapshot = None if snap is None else [t.clone() for t in snap]
        self.snapshot_step = int(sd.get("snapshot_step", 0))
        self.quiet_checks = int(sd.get("quiet_checks", 0))
        self.last_drift = sd.get("last_drift")
        self.last_lr = sd.get("last_lr")


def _sum_over(
    x: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """Sum a tiny float64 tensor over ``group`` (identity without a process group).

    It travels on ``device`` (the buffers' device) so that NCCL groups get a CUDA tensor.
    """
    w = collectives.world_size(group)
    if w == 1:
        return x
    x = x.to(device)
    dist.all_reduce(x, group=group)
    x = x.cpu()
    moved = stats.ring_allreduce_bytes(x.numel() * x.element_size(), w)
    stats.record("freeze_check", moved, moved)
    return x
