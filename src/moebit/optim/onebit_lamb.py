"""1-bit LAMB: exact LAMB warm-up, then 1-bit momentum with a frozen, corrected trust ratio.

Algorithm (docs/optimizers.md; Li et al. 2021, arXiv:2104.06069), per param group:

- warm-up (steps 1..freeze_step): LAMB (``moebit.optim.lamb``) on exactly averaged
  gradients; the per-parameter trust ratios, clipped to [min_coeff, max_coeff], feed an
  exponential moving average (``coeff_beta``).
- freeze: v is frozen (its bias correction folded in once, as in 1-bit Adam) and a copy
  v_fresh is kept, which goes on tracking the variance; the EMA of the trust ratios is
  frozen too (bias-corrected: 1 - coeff_beta^T, so a short warm-up is not biased towards
  0); each parameter gets a momentum scale s_i = mean_j(rms(m_j)) / rms(m_i) from the
  momenta at the freeze (identical on every rank, hence reversible identically).
- compression stage: m = β1·m + (1-β1)·g_local; every m_i is multiplied by s_i, all momenta
  of the group (one flat buffer) go through ONE 1-bit allreduce, and are divided by s_i:
  the scaling evens out the parameters' magnitudes so that the one-scale-per-chunk sign
  compression does not drown small tensors (LayerNorm, biases) in large ones. The
  gradient is reconstructed as g = (m_t - β1·m_{t-1})/(1-β1) and keeps v_fresh current.
  The LAMB coefficient of parameter i is frozen_ema_i × factor_i, where
  factor_i = max((sqrt(v)+eps)/(sqrt(v_fresh)+eps)) over the parameter's elements (the
  frozen preconditioner over-damps by up to this much where the variance has dropped),
  mixed towards 1 by the weight-decay share of the update as in DeepSpeed, clipped to
  [factor_min, factor_max] and to a relative change of at most ±factor_threshold per step.

Memory: m, v, and from the freeze v_fresh and m_{t-1} (4·n), plus the compressor's errors
(n + n/W), plus one update-sized temporary per step (LAMB needs a whole update's norm
before applying it).

Training-loop contract: ``averages_gradients = True``; ``comm_stage`` is "warmup" or
"compressed"; ``frozen_at`` the last warm-up step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from moebit.optim.base import Bucket, CompressedOptimizer, check_range, check_step_arg
from moebit.optim.lamb import apply_scaled_, check_coeffs, lamb_updates, norms, trust_ratios

logger = logging.getLogger("moebit.optim")


class OnebitLamb(CompressedOptimizer):
    """1-bit LAMB; see the module docstring. DeepSpeed's parameter names and defaults.

    Args:
        params: parameters or param groups; a group may carry ``process_group`` and
            ``exp_avg_mask`` as in OnebitAdam.
        lr, betas, eps, weight_decay: as in AdamW (weight decay inside the LAMB update).
        freeze_step: exact LAMB warm-up steps (DeepSpeed's default 100000).
        max_coeff, min_coeff: trust-ratio clipping in warm-up.
        coeff_beta: EMA factor of the trust ratios.
        factor_max, factor_min, factor_threshold: clipping of the fresh-variance factor
            and of its relative change per step.
        process_group: default group of the param groups (None: the world).
        bias_correction: Adam's bias correction (False: DeepSpeed's uncorrected variant).
        cuda_aware, comm_backend_name: DeepSpeed transport settings, accepted and unused.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        process_group: dist.ProcessGroup | None = None,
        *,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        bias_correction: bool = True,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "gloo",
    ) -> None:
        if amsgrad:
            raise ValueError("OnebitLamb does not support amsgrad=True (v is frozen)")
        if freeze_step == "auto":
            raise ValueError(
                "OnebitLamb: freeze_step='auto' is not supported (only OnebitAdam has the auto "
                "rule); give the number of exact LAMB warm-up steps"
            )
        self.freeze_step = check_step_arg(
            "freeze_step", freeze_step, "the number of exact LAMB warm-up steps")
        check_coeffs(min_coeff, max_coeff)
        self.min_coeff, self.max_coeff = float(min_coeff), float(max_coeff)
        self.coeff_beta = check_range("coeff_beta", coeff_beta, 0.0, 1.0)
        if self.coeff_beta == 1.0:
            raise ValueError("invalid coeff_beta 1.0: the trust-ratio EMA would never move")
        self.factor_min = check_range("factor_min", factor_min, 0.0, 1.0, lo_open=True)
        self.factor_max = check_range("factor_max", factor_max, 1.0)
        self.factor_threshold = check_range("factor_threshold", factor_threshold, 0.0, 1.0)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, process_group)
        self.bias_correction = bool(bias_correction)
        # Per bucket (by name): small per-parameter vectors.
        self._coeff: dict[str, dict[str, torch.Tensor]] = {}

    def _vectors(self, b: Bucket) -> dict[str, torch.Tensor]:
        v = self._coeff.get(b.name)
        if v is None:
            v = self._coeff[b.name] = {
                "coeff_ema": torch.zeros(len(b.params), dtype=torch.float64, device=b.params[0].device)
            }
        return v

    def _extra_state_tensors(self) -> list[torch.Tensor]:
        return [t for d in self._coeff.values() for t in d.values()]

    def _should_freeze(self, t: int) -> bool:
        return t >= self.freeze_step

    def _warmup_bucket(self, group: dict[str, Any], b: Bucket, t: int) -> None:
        """Exact LAMB on averaged gradients (``Lamb.step``'s operations)."""
        grads = self._grads(b)
        self._average_grads_(group, grads, "onebit_lamb.warmup")
        b1, b2 = group["betas"]
        self._adam_moments_(b, grads, b1, b2)
        del grads
        bc1, bc2 = self._corrections(group, t)
        updates = lamb_updates(b.params, b.m_views, b.v_views, bc1, math.sqrt(bc2), group["eps"],
                               group["weight_decay"])
        ratios = trust_ratios(b.params, updates, self.min_coeff, self.max_coeff)
        apply_scaled_(b.params, updates, group["lr"], ratios)
        ema = self._vectors(b)["coeff_ema"]
        ema.mul_(self.coeff_beta).add_(ratios.to(ema.device), alpha=1.0 - self.coeff_beta)

    def _freeze(self, t: int) -> None:
        """Freeze v (bias correction folded in), snapshot v_fresh, fix coefficients and scales."""
        for _, group, b in self._iter_buckets():
            _, bc2 = self._corrections(group, t)
            b.exp_avg_sq.div_(bc2)
            self._add_flat(b, "exp_avg_sq_fresh").copy_(b.exp_avg_sq)
            self._add_flat(b, "exp_avg_prev")
            vec = self._vectors(b)
            vec["coeff_frozen"] = vec["coeff_ema"] / (1.0 - self.coeff_beta**t)
            dev = b.exp_avg.device
            vec["last_factor"] = torch.ones(len(b.params), dtype=torch.float64, device=dev)
            sqrt_n = torch.tensor([math.sqrt(n) for n in b.sizes], dtype=torch.float64, device=dev)
            rms = norms(b.m_views) / sqrt_n
            united = rms.mean()
            vec["scaling"] = torch.where(rms > 0, united / rms.clamp_min(1e-38), torch.ones_like(rms))
        self._frozen_at = t
        logger.info("OnebitLamb: variance and trust ratios frozen after step %d; 1-bit momentum "
                    "from now on", t)

    def _compressed_bucket(self, gi: int, group: dict[str, Any], b: Bucket, t: int) -> None:
        vec = self._vectors(b)
        b1, b2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        prev = b.views["exp_avg_prev"]
        b.flats["exp_avg_prev"].copy_(b.exp_avg)
        grads = self._grads(b)
        self._adam_moments_(b, grads, b1, None)
        del grads
        scaling = vec["scaling"].tolist()
        if self._world(group) > 1:
            torch._foreach_mul_(b.m_views, scaling)
            self._onebit_average_(gi, b, b.exp_avg)
            torch._foreach_div_(b.m_views, scaling)
        self._apply_masks(b, b.m_views)
        # The averaged gradient, reconstructed from the momentum, keeps v_fresh current.
        torch._foreach_mul_(prev, -b1)
        torch._foreach_add_(prev, b.m_views)
        torch._foreach_div_(prev, 1.0 - b1)
        fresh = b.views["exp_avg_sq_fresh"]
        torch._foreach_mul_(fresh, b2)
        torch._foreach_addcmul_(fresh, prev, prev, value=1.0 - b2)
        bc1, _ = self._corrections(group, t)
        updates = lamb_updates(b.params, b.m_views, b.v_views, bc1, None, eps, 0.0)
        factors = torch.stack([
            ((v.sqrt() + eps) / (f.sqrt() + eps)).max().double()
            for v, f in zip(b.v_views, fresh, strict=True)
        ]) if b.params else torch.zeros(0, dtype=torch.float64)
        if wd != 0.0:
            prelim = norms(updates)
            for u, p in zip(updates, b.params, strict=True):
                u.add_(p, alpha=wd)
            full = norms(updates)
            share = torch.where(full > 0, prelim / full.clamp_min(1e-38), torch.ones_like(full))
            share = share.clamp_(max=1.0)
            factors = factors * share + (1.0 - share)
        last = vec["last_factor"]
        factors = factors.clamp_(self.factor_min, self.factor_max)
        factors = torch.minimum(torch.maximum(factors, last * (1.0 - self.factor_threshold)),
                                last * (1.0 + self.factor_threshold))
        vec["last_factor"] = factors
        apply_scaled_(b.params, updates, group["lr"], vec["coeff_frozen"] * factors)

    @property
    def lamb_coeffs(self) -> dict[str, torch.Tensor]:
        """Per bucket: the trust-ratio EMA (warm-up) or the coefficients in use (after)."""
        out = {}
        for name, vec in self._coeff.items():
            out[name] = vec["coeff_ema"] if "coeff_frozen" not in vec else (
                vec["coeff_frozen"] * vec["last_factor"])
        return out

    # --------------------------------------------------------------------- checkpoint
    def _extra_state(self) -> dict[str, Any]:
        return {"coeffs": {k: {n: t.clone() for n, t in d.items()} for k, d in self._coeff.items()}}

    def _load_extra_state(self, ob: dict[str, Any]) -> None:
        self._coeff = {k: {n: t.clone() for n, t in d.items()} for k, d in ob["coeffs"].items()}
