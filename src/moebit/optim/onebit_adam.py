"""1-bit Adam: exact Adam during warm-up, then only 1-bit momentum crosses the network.

Algorithm (docs/optimizers.md; Tang et al. 2021, arXiv:2102.02888):

- warm-up (steps 1..freeze_step): Adam(W) on gradients averaged over each param group's
  process group. Standalone, the optimizer averages them itself with one bucketed exact
  allreduce per group; under DDP (``grads_averaged_externally=True``) DDP has done it.
- freeze: v is frozen for good and becomes a fixed preconditioner.
- compression stage: m = β1·m + (1-β1)·g_local; the momenta of a group, which live in one
  flat buffer, go through ONE error-compensated 1-bit allreduce; the group's
  ``exp_avg_mask`` is applied; p -= lr·(m̂ / (sqrt(v̂) + eps) + wd·p).

Bias correction (DeepSpeed has none). Warm-up keeps Adam's corrections, so warm-up IS
torch's Adam/AdamW (bit for bit on one rank). At the freeze, v's correction 1/(1-β2^T)
is folded into v once: the frozen preconditioner is the unbiased estimate at step T, not
one that stays too small forever (with T=100 and β2=0.999 an uncorrected v is 10x too
small, i.e. 3x too large steps for the rest of the run). m keeps its scalar correction
1/(1-β1^t): m is still the same EMA after the freeze (of averaged gradients, through the
compressed allreduce), the factor costs nothing and is ~1 once t >> 1/(1-β1), and keeping
it makes the first compressed step continue the warm-up trajectory exactly.

Memory. m and v of a group are each ONE flat buffer per (device, dtype); the per-parameter
``state[p]["exp_avg"]`` and ``["exp_avg_sq"]`` are views into them, so handing m to the
allreduce copies nothing (it writes the average in place). The compressor adds a worker
error (n, fp32) and a server error (n/W, its chunk padded to 8·W) after the freeze:
(2 + 1 + 1/W)·n against torch Adam's 2·n, i.e. 1.75x at W=2, 1.625x at W=4 (measured).
``freeze_step="auto"`` keeps one snapshot of sqrt(v̂) during warm-up only (1.5x), dropped
at the freeze. No step allocates a model-sized temporary (see ``CompressedOptimizer._adam_apply``).

Training-loop contract: ``averages_gradients = True`` tells a loop not to allreduce
gradients itself; ``comm_stage`` and ``frozen_at`` are there to be logged.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moebit.optim.base import Bucket, CompressedOptimizer
from moebit.optim.freeze import AutoFreeze

logger = logging.getLogger("moebit.optim")


class FreezableHookState(Protocol):
    """What the optimizer needs from a DDP comm-hook state: a way to silence it."""

    def freeze(self) -> None: ...


def _check_freeze_step(freeze_step: Any) -> None:
    if freeze_step == "auto":
        return
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(
            f"invalid freeze_step {freeze_step!r}: expected an int >= 1 (the number of exact "
            "Adam warm-up steps; the frozen variance needs at least one) or 'auto'"
        )


class OnebitAdam(CompressedOptimizer):
    """1-bit Adam; see the module docstring for the algorithm and its choices.

    Args:
        params: parameters or param groups. A group may carry ``process_group`` (its
            gradients and momenta are averaged over that group, e.g. an expert-data-parallel
            group for MoE experts) and ``exp_avg_mask`` (a tensor broadcastable to each of
            the group's params, or a list with one tensor/None per param), multiplied into
            m after each compressed allreduce since 1-bit cannot encode exact zeros.
        lr, betas, eps, weight_decay: as in AdamW (weight decay is decoupled).
        freeze_step: number of exact warm-up steps, or "auto" (``moebit.optim.freeze``).
        process_group: default group of the param groups (None: the world); also the group
            over which the auto-freeze decision is agreed.
        bias_correction: Adam's bias correction (see module docstring); False reproduces
            DeepSpeed's uncorrected variant.
        grads_averaged_externally: True under DDP: gradients arrive already averaged in
            warm-up, so the optimizer sends nothing then.
        ddp_hook_state: the state of moebit's freezable DDP hook; ``freeze()`` is called at
            the freeze so DDP stops allreducing gradients.
        auto_freeze: thresholds of the auto rule, an ``AutoFreeze`` or a dict of its
            fields (default ``AutoFreeze()``).
        amsgrad: accepted only as False (AMSGrad's running max of v has no 1-bit analogue).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str = "auto",
        process_group: dist.ProcessGroup | None = None,
        *,
        bias_correction: bool = True,
        grads_averaged_externally: bool = False,
        ddp_hook_state: FreezableHookState | None = None,
        auto_freeze: AutoFreeze | dict[str, Any] | None = None,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "OnebitAdam does not support amsgrad=True: the running maximum of v cannot be "
                "kept once v is frozen and only 1-bit momentum is exchanged"
            )
        _check_freeze_step(freeze_step)
        if auto_freeze is not None and freeze_step != "auto":
            raise ValueError("auto_freeze thresholds were given but freeze_step is not 'auto'")
        if ddp_hook_state is not None and not grads_averaged_externally:
            raise ValueError(
                "ddp_hook_state is for use under DDP: pass grads_averaged_externally=True too "
                "(otherwise gradients would be averaged twice)"
            )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, process_group, grads_averaged_externally)
        self.freeze_step = freeze_step
        self.bias_correction = bool(bias_correction)
        self.ddp_hook_state = ddp_hook_state
        if isinstance(auto_freeze, dict):  # from a config file: AutoFreeze's field names
            auto_freeze = AutoFreeze(**auto_freeze)
        self.auto_freeze = (auto_freeze or AutoFreeze()) if freeze_step == "auto" else None
        self._warned_ddp = False

    def _extra_state_tensors(self) -> list[torch.Tensor]:
        if self.auto_freeze is not None and self.auto_freeze.snapshot is not None:
            return list(self.auto_freeze.snapshot)
        return []

    def _warmup_bucket(self, group: dict[str, Any], b: Bucket, t: int) -> None:
        """Adam on averaged gradients; after it, ``p.grad`` holds the average (as with DDP)."""
        grads = self._grads(b)
        self._average_grads_(group, grads, "onebit_adam.warmup")
        b1, b2 = group["betas"]
        self._adam_moments_(b, grads, b1, b2)
        del grads
        bc1, bc2 = self._corrections(group, t)
        self._adam_apply(group, b, group["lr"] / bc1, math.sqrt(bc2))

    def _compressed_bucket(self, gi: int, group: dict[str, Any], b: Bucket, t: int) -> None:
        grads = self._grads(b)
        self._adam_moments_(b, grads, group["betas"][0], None)
        del grads
        # In place: the compressor keeps its own copy of what it has not yet delivered.
        self._onebit_average_(gi, b, b.exp_avg)
        self._apply_masks(b, b.m_views)
        bc1, _ = self._corrections(group, t)
        self._adam_apply(group, b, group["lr"] / bc1, None)  # v̂ was bias-corrected at the freeze

    # ------------------------------------------------------------------------- freeze
    def _should_freeze(self, t: int) -> bool:
        if self.auto_freeze is None:
            return t >= int(self.freeze_step)
        vs = [b.exp_avg_sq for bs in self._buckets for b in bs]
        if not vs:
            return False
        # The correction of the first group stands for all: groups rarely differ in β2,
        # and the rule only needs a consistent scale between two snapshots.
        _, bc2 = self._corrections(self.param_groups[0], t)
        lr = max(float(g["lr"]) for g in self.param_groups)
        return self.auto_freeze.observe(t, vs, bc2, self._default_pg, lr=lr)

    def _freeze(self, t: int) -> None:
        """Freeze v after warm-up step ``t``, folding in its bias correction once."""
        for _, group, b in self._iter_buckets():
            _, bc2 = self._corrections(group, t)
            b.exp_avg_sq.div_(bc2)
        self._frozen_at = t
        if self.auto_freeze is not None:
            self.auto_freeze.release()
        self._freeze_hook()
        how = "auto" if self.auto_freeze is not None else f"freeze_step={self.freeze_step}"
        drift = "" if self.auto_freeze is None else f", drift {self.auto_freeze.last_drift:.4g}"
        logger.info(
            "OnebitAdam: variance frozen after step %d (%s%s); 1-bit momentum from now on",
            t, how, drift,
        )

    def _freeze_hook(self) -> None:
        if self.ddp_hook_state is not None:
            self.ddp_hook_state.freeze()
        elif self.grads_averaged_externally and not self._warned_ddp:
            self._warned_ddp = True
            warnings.warn(
                "OnebitAdam froze its variance but has no ddp_hook_state: DDP keeps "
                "allreducing exact gradients, so nothing is saved. Register moebit's freezable "
                "DDP hook and pass its state as ddp_hook_state.",
                stacklevel=3,
            )

    # --------------------------------------------------------------------- checkpoint
    def _extra_state(self) -> dict[str, Any]:
        return {"auto_freeze": None if self.auto_freeze is None else self.auto_freeze.state_dict()}

    def _load_extra_state(self, ob: dict[str, Any]) -> None:
        if self.auto_freeze is not None and ob.get("auto_freeze") is not None:
            self.auto_freeze.load_state_dict(ob["auto_freeze"])

    def _after_load(self) -> None:
        if self._frozen_at is not None:
            self._freeze_hook()
