"""0/1 Adam: adaptive variance freezing, then local steps with 1-bit synchronisation.

Algorithm (docs/optimizers.md; Lu et al. 2022, arXiv:2202.06009), per param group:

- stage 1 (steps 1..var_freeze_step): on steps where ``step % var_interval == 0`` the
  gradients are averaged EXACTLY and both m and v are updated (a "variance refresh");
  on the other steps the gradients go through the error-compensated 1-bit allreduce and
  only m is updated. After every ``var_update_scaler`` refreshes ``var_interval`` doubles,
  so refreshes (the only full-size messages) become rarer as v settles. Every step the
  parameters move by Adam's update with the current m and v.
- at var_freeze_step: v is frozen (its bias correction folded in once, as in 1-bit Adam)
  and the 1-bit error buffers are zeroed once: they held gradient residuals, and from now
  on the compressed quantity is a different one.
- stage 2: every rank takes LOCAL steps (nothing is sent): m = β1·m + (1-β1)·g_local,
  p -= lr·(m̂/(sqrt(v̂)+eps) + wd·p). Every ``local_step_interval`` steps the ranks
  synchronise: the local progress u (what the local steps added) is scaled to momentum
  units, x = u·(sqrt(v̂)+eps), and 1-bit averaged; m = -x̄/Σlr (the lr-weighted average
  momentum of the interval) and every rank applies the same averaged progress
  x̄/(sqrt(v̂)+eps). ``local_step_interval`` doubles every ``local_step_scaler`` stage-2
  steps, capped at ``local_step_clipper``.

Our choices, and why:

- Undoing the local steps. DeepSpeed keeps u = Σ -lr·update and undoes it with p -= u,
  which leaves replicas equal only up to rounding (p + d1 + d2 - (d1 + d2) != p in floating
  point). We keep the parameters of the last synchronisation instead (the ``anchor``, the
  same memory as u) and set p = anchor·D + x̄/(sqrt(v̂)+eps), where D = Π(1 - lr·wd) is the
  decoupled weight decay of the interval: every term is identical on every rank, so the
  replicas are bitwise identical after each synchronisation. u = p - anchor·D is computed
  at the synchronisation only; it excludes the weight decay, so m = -x̄/Σlr is a clean
  momentum (DeepSpeed's accumulator mixes wd·p into m). Between synchronisations the
  replicas differ: that is the point of local steps.
- Bias correction: m̂ = m/(1-β1^t); v's correction counts v's own refreshes, not steps.
  With ``var_update_scaler`` large enough that var_interval stays 1, stage 1 on one rank
  is torch's Adam(W), bit for bit.
- ``comm_rounds`` counts the steps on which this optimizer communicated (exact or 1-bit):
  the quantity the paper reduces. Stage-1 steps always communicate; stage-2 steps only at
  synchronisations.

Memory: m, v, and from the freeze the anchor (n), plus the compressor's errors (n + n/W):
(3 + 1 + 1/W)·n in stage 2 against torch Adam's 2·n.

Training-loop contract: ``averages_gradients = True``; ``comm_stage`` is "variance"
(stage 1), "local" (stage 2; the model differs between ranks until the next
synchronisation) ; ``frozen_at`` is the last stage-1 step. ``synchronize()`` forces a
synchronisation (e.g. before evaluating or saving the model of one rank).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from moebit.optim.base import CompressedOptimizer, check_step_arg, chunks

logger = logging.getLogger("moebit.optim")


class ZeroOneAdam(CompressedOptimizer):
    """0/1 Adam; see the module docstring for the algorithm and its choices.

    Args:
        params: parameters or param groups; a group may carry ``process_group`` and
            ``exp_avg_mask`` (multiplied into m after every 1-bit exchange), as in OnebitAdam.
        lr, betas, eps, weight_decay: as in AdamW (weight decay is decoupled).
        var_freeze_step: last step of stage 1 (DeepSpeed's default 100000; the training
            loop passes its ``freeze_step`` here, 20% of the run by default).
        var_update_scaler: refreshes of v between doublings of the refresh interval.
        local_step_scaler: stage-2 steps between doublings of the synchronisation interval.
        local_step_clipper: the largest synchronisation interval.
        process_group: default group of the param groups (None: the world).
        bias_correction: Adam's bias correction (False: DeepSpeed's uncorrected variant).
        freeze_step: an alias of ``var_freeze_step`` (the name every moebit optimizer takes).
        cuda_aware, comm_backend_name: DeepSpeed transport settings, accepted and unused.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        process_group: dist.ProcessGroup | None = None,
        *,
        bias_correction: bool = True,
        precondition_compression: bool = True,
        freeze_step: int | str | None = None,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "gloo",
    ) -> None:
        if amsgrad:
            raise ValueError("ZeroOneAdam does not support amsgrad=True (v is frozen in stage 2)")
        if freeze_step is not None:
            if freeze_step == "auto":
                raise ValueError(
                    "ZeroOneAdam: freeze_step='auto' is not supported (0/1 Adam already adapts "
                    "its variance refreshes); give var_freeze_step as a step count"
                )
            var_freeze_step = freeze_step  # type: ignore[assignment]
        self.var_freeze_step = check_step_arg(
            "var_freeze_step", var_freeze_step, "the last step that may refresh the variance")
        self.var_update_scaler = check_step_arg(
            "var_update_scaler", var_update_scaler, "variance refreshes per doubling of the interval")
        self.local_step_scaler = check_step_arg(
            "local_step_scaler", local_step_scaler, "local steps per doubling of the sync interval")
        self.local_step_clipper = check_step_arg(
            "local_step_clipper", local_step_clipper, "the largest sync interval")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, process_group)
        self._scratch_names = ("grad",)  # the 1-bit gradient of stage 1: not state
        self.bias_correction = bool(bias_correction)
        self.precondition_compression = bool(precondition_compression)
        # Stage-1 counters.
        self.var_interval = 1
        self.var_counter = 0  # refreshes since the interval last doubled
        self.var_updates = 0  # refreshes so far (v's bias correction)
        # Stage-2 counters.
        self.local_step_interval = 1
        self.local_step_counter = 0  # stage-2 steps since the interval last doubled
        self.since_sync = 0
        self._lrs: list[float] = []  # per group: Σ step sizes since the last sync
        self._decay: list[float] = []  # per group: Π (1 - lr·wd) since the last sync
        self.comm_rounds = 0

    @property
    def comm_stage(self) -> str:
        """"variance" (stage 1: every step communicates) or "local" (stage 2)."""
        return "variance" if self._frozen_at is None else "local"

    # ----------------------------------------------------------------------- stepping
    def _step(self, t: int) -> None:
        if self._frozen_at is None:
            self._stage1(t)
            if t >= self.var_freeze_step:
                self._freeze(t)
        else:
            self._local_step(t)
            self.since_sync += 1
            if self.since_sync >= self.local_step_interval:
                self._sync()
            self.local_step_counter += 1
            if self.local_step_counter >= self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(2 * self.local_step_interval, self.local_step_clipper)

    @property
    def next_step_averages_exactly(self) -> bool:
        """Only stage-1 steps that refresh the variance average exact gradients; the others
        exchange 1-bit compressed ones."""
        return self._frozen_at is None and (self._step_count + 1) % self.var_interval == 0

    def _stage1(self, t: int) -> None:
        refresh = t % self.var_interval == 0
        if refresh:
            self.var_updates += 1
        sent = False
        for gi, group, b in self._iter_buckets():
            grads = self._grads(b)
            b1, b2 = group["betas"]
            if refresh:
                sent |= self._average_grads_(group, grads, "zero_one_adam.var")
                self._adam_moments_(b, grads, b1, b2)
            else:
                if self._world(group) > 1:
                    flat = b.flats.get("grad")
                    if flat is None:
                        flat = self._add_flat(b, "grad")
                    torch._foreach_copy_(b.views["grad"], grads)
                    if self.precondition_compression:
                        self._precondition_(group, b, b.views["grad"], t, divide=True)
                    sent |= self._onebit_average_(gi, b, flat)
                    if self.precondition_compression:
                        self._precondition_(group, b, b.views["grad"], t, divide=False)
                    self._apply_masks(b, b.views["grad"])
                    grads = b.views["grad"]
                self._adam_moments_(b, grads, b1, None)
            del grads
            bc1, bc2 = self._corrections(group, t, self.var_updates)
            self._adam_apply(group, b, group["lr"] / bc1, math.sqrt(bc2))
        self.comm_rounds += int(sent)
        if refresh:
            self.var_counter += 1
            if self.var_counter >= self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2

    def _precondition_(self, group: dict[str, Any], b: Any, views: list[torch.Tensor], t: int,
                       divide: bool) -> None:
        """Divide (or multiply back) by sqrt(v̂)+eps, the same on every rank (v is exact)."""
        _, bc2 = self._corrections(group, t, self.var_updates)
        root_bc2, eps = math.sqrt(bc2), group["eps"]
        for g, v in zip(views, b.v_views, strict=True):
            for gc, vc in chunks(g, v):
                denom = vc.sqrt().div_(root_bc2).add_(eps)
                if divide:
                    gc.div_(denom)
                else:
                    gc.mul_(denom)

    def _freeze(self, t: int) -> None:
        """End of stage 1: fold v's bias correction in, zero the error buffers once."""
        for _, group, b in self._iter_buckets():
            _, bc2 = self._corrections(group, t, self.var_updates)
            b.exp_avg_sq.div_(bc2)
            self._drop_flat(b, "grad")  # the 1-bit gradient buffer is a stage-1 scratch
            self._add_flat(b, "anchor")
            torch._foreach_copy_(b.views["anchor"], b.params)
        for comp in self._compressors.values():
            comp.reset()
        self._frozen_at = t
        self._lrs = [0.0] * len(self.param_groups)
        self._decay = [1.0] * len(self.param_groups)
        self.since_sync = 0
        logger.info("ZeroOneAdam: variance frozen after step %d (%d refreshes); local steps "
                    "from now on", t, self.var_updates)

    def _local_step(self, t: int) -> None:
        """Adam step with frozen v on the local gradient; nothing is sent."""
        for gi, group, b in self._iter_buckets():
            grads = self._grads(b)
            self._adam_moments_(b, grads, group["betas"][0], None)
            del grads
            bc1, _ = self._corrections(group, t)
            step_size = group["lr"] / bc1
            self._adam_apply(group, b, step_size, None)
            self._lrs[gi] += step_size
            self._decay[gi] *= 1.0 - group["lr"] * group["weight_decay"]

    def _sync(self) -> None:
        """Average the local progress since the last sync in 1-bit, identically everywhere."""
        sent = False
        for gi, group, b in self._iter_buckets():
            decay, lrs, eps = self._decay[gi], self._lrs[gi], group["eps"]
            # x = u·(sqrt(v)+eps) with u = p - anchor·D, written into m's buffer (m is
            # rebuilt from the average below).
            pre = self.precondition_compression
            for p, a, m, v in zip(b.params, b.views["anchor"], b.m_views, b.v_views, strict=True):
                for pc, ac, mc, vc in chunks(p, a, m, v):
                    torch.sub(pc, ac, alpha=decay, out=mc)
                    if not pre:
                        mc.mul_(vc.sqrt().add_(eps))
            sent |= self._onebit_average_(gi, b, b.exp_avg)
            self._apply_masks(b, b.m_views)
            for p, a, m, v in zip(b.params, b.views["anchor"], b.m_views, b.v_views, strict=True):
                for pc, ac, mc, vc in chunks(p, a, m, v):
                    pc.copy_(ac)
                    if decay != 1.0:
                        pc.mul_(decay)
                    if pre:  # mc holds the averaged u
                        pc.add_(mc)
                        mc.mul_(vc.sqrt().add_(eps))
                    else:  # mc holds the averaged u·(sqrt(v)+eps)
                        pc.addcdiv_(mc, vc.sqrt().add_(eps))
                    ac.copy_(pc)
                    if lrs > 0.0:
                        mc.div_(-lrs)
            self._lrs[gi] = 0.0
            self._decay[gi] = 1.0
        self.since_sync = 0
        self.comm_rounds += int(sent)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Synchronise now if local steps are pending (a collective: call on every rank)."""
        if self._frozen_at is not None and self.since_sync > 0:
            self._sync()

    # --------------------------------------------------------------------- checkpoint
    def _extra_state(self) -> dict[str, Any]:
        return {
            "var_freeze_step": self.var_freeze_step,
            "var_interval": self.var_interval,
            "var_counter": self.var_counter,
            "var_updates": self.var_updates,
            "local_step_interval": self.local_step_interval,
            "local_step_counter": self.local_step_counter,
            "since_sync": self.since_sync,
            "lrs": list(self._lrs),
            "decay": list(self._decay),
            "comm_rounds": self.comm_rounds,
        }

    def _load_extra_state(self, ob: dict[str, Any]) -> None:
        self.var_interval = int(ob["var_interval"])
        self.var_counter = int(ob["var_counter"])
        self.var_updates = int(ob["var_updates"])
        self.local_step_interval = int(ob["local_step_interval"])
        self.local_step_counter = int(ob["local_step_counter"])
        self.since_sync = int(ob["since_sync"])
        self._lrs = [float(x) for x in ob["lrs"]]
        self._decay = [float(x) for x in ob["decay"]]
        self.comm_rounds = int(ob["comm_rounds"])
