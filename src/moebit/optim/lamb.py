"""LAMB, exact (uncompressed): the baseline of 1-bit LAMB, and its warm-up's arithmetic.

LAMB (You et al. 2019, arXiv:1904.00962) is Adam(W) whose step is rescaled per parameter
by a trust ratio ||p|| / ||update||, so every layer moves by about the same relative
amount whatever its gradient scale. As in DeepSpeed's 1-bit LAMB, the ratio is clipped to
[min_coeff, max_coeff] (0.01, 10 by default) and counts as 1 when either norm is zero
(a zero-initialised bias must still move). Bias correction is applied (LAMB's Algorithm 2).

``lamb_updates`` and ``apply_scaled_`` are shared with ``OnebitLamb``: its warm-up runs
exactly these operations, so on one rank it is this optimizer, bit for bit.

Gradients: like torch's optimizers, ``Lamb`` uses ``p.grad`` as it is; under data
parallelism the training loop (or DDP) averages them first (``averages_gradients`` is
False). This keeps the baseline exactly what one would run without moebit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from moebit.optim.base import check_hparams, check_range


def check_coeffs(min_coeff: Any, max_coeff: Any) -> None:
    check_range("min_coeff", min_coeff, 0.0)
    check_range("max_coeff", max_coeff, 0.0, lo_open=True)
    if min_coeff > max_coeff:
        raise ValueError(f"min_coeff {min_coeff!r} must not exceed max_coeff {max_coeff!r}")


def lamb_updates(
    params: Sequence[torch.Tensor],
    ms: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    bc1: float,
    bc2_sqrt: float | None,
    eps: float,
    weight_decay: float,
) -> list[torch.Tensor]:
    """Adam's direction per parameter: (m/bc1) / (sqrt(v)/bc2_sqrt + eps) + wd·p.

    ``bc2_sqrt`` None: v is already bias-corrected (frozen). New tensors: LAMB needs the
    whole update's norm before it may apply any of it.
    """
    out = []
    for p, m, v in zip(params, ms, vs, strict=True):
        denom = v.sqrt()
        if bc2_sqrt is not None:
            denom = denom.div_(bc2_sqrt)
        u = (m / bc1).div_(denom.add_(eps))
        if weight_decay != 0.0:
            u.add_(p, alpha=weight_decay)
        out.append(u)
    return out


def norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each tensor (in its own dtype), as one float64 vector (no host sync):
    the ratio of two norms then loses nothing, whatever the parameters' dtype."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([n.double() for n in torch._foreach_norm(list(tensors))])


def trust_ratios(
    params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], min_coeff: float, max_coeff: float
) -> torch.Tensor:
    """||p|| / ||update|| per parameter, 1 where either is zero, clipped to [min, max]."""
    w, u = norms(params), norms(updates)
    ratio = torch.where((w > 0) & (u > 0), w / u.clamp_min(1e-38), torch.ones_like(w))
    return ratio.clamp_(min_coeff, max_coeff)


def apply_scaled_(
    params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], lr: float, coeffs: torch.Tensor
) -> None:
    """p -= lr·coeff_i·update_i (the updates are consumed)."""
    for i, (p, u) in enumerate(zip(params, updates, strict=True)):
        p.add_(u.mul_(coeffs[i].to(u.dtype)), alpha=-lr)


class Lamb(Optimizer):
    """Exact LAMB. Args as AdamW, plus ``min_coeff``/``max_coeff`` (trust-ratio clipping)
    and ``bias_correction``. ``opt.last_ratios[gi]`` holds the last step's trust ratios of
    group ``gi`` (for logging)."""

    averages_gradients = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        min_coeff: float = 0.01,
        max_coeff: float = 10.0,
        bias_correction: bool = True,
    ) -> None:
        check_hparams(lr, betas, eps, weight_decay, "Lamb")
        check_coeffs(min_coeff, max_coeff)
        defaults = dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                        weight_decay=float(weight_decay), min_coeff=float(min_coeff),
                        max_coeff=float(max_coeff), bias_correction=bool(bias_correction))
        super().__init__(params, defaults)
        self.last_ratios: dict[int, torch.Tensor] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        where = f"Lamb param group {len(self.param_groups) - 1}"
        check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"], where)
        check_coeffs(g["min_coeff"], g["max_coeff"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = []
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                grads.append(p.grad)
            ms, vs = [], []
            for p in params:
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                ms.append(st["exp_avg"])
                vs.append(st["exp_avg_sq"])
            t = self.state[params[0]]["step"]
            b1, b2 = group["betas"]
            torch._foreach_lerp_(ms, grads, 1.0 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - b2)
            bc1, bc2 = (1.0 - b1**t, 1.0 - b2**t) if group["bias_correction"] else (1.0, 1.0)
            updates = lamb_updates(params, ms, vs, bc1, math.sqrt(bc2), group["eps"],
                                   group["weight_decay"])
            ratios = trust_ratios(params, updates, group["min_coeff"], group["max_coeff"])
            apply_scaled_(params, updates, group["lr"], ratios)
            self.last_ratios[gi] = ratios
        return loss
