"""Gradients between backward and the optimizer step: averaging, clipping, NaN verdicts.

Every decision here is taken identically on every rank (the same average, the same clip
norm, the same skip), because a rank that decides alone leaves the others blocked in the
next collective until the process-group timeout.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moebit.comm import stats
from moebit.comm.collectives import allreduce_mean_
from moebit.models.interface import is_expert_param


class NonFiniteLoss(RuntimeError):
    """The loss or the gradients became NaN or inf and ``on_nan`` says stop."""


def average_gradients(opt: torch.optim.Optimizer) -> None:
    """Average each group's gradients over its process group (experts: expert-dp only).

    With an outer optimizer (DiLoCo) the groups carry the inner groups
    (``moebit.training.setup.param_groups`` with ``groups``): the average then stays
    inside the worker, and the outer optimizer refuses a group that spans workers.

    A missing gradient (an expert that received no token here) counts as zeros, so every
    rank hands the collective buffers of the same size.
    """
    for group in opt.param_groups:
        grads = []
        for p in group["params"]:
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        allreduce_mean_(grads, group=group.get("process_group"), op_name="grad_allreduce")


def average_for_step(opt: torch.optim.Optimizer) -> bool:
    """Average this step's gradients here unless the optimizer will exchange them itself.

    Plain optimizers: always. Compressed ones: only on the steps they would average exactly
    (1-bit Adam's warm-up), so that clipping then acts on the average, as for Adam, and the
    warm-up equals Adam's run step for step. Returns True when the gradients are now the
    average on every rank (a NaN anywhere has then reached every rank).
    """
    if not getattr(opt, "averages_gradients", False):
        average_gradients(opt)
        return True
    if getattr(opt, "next_step_averages_exactly", False):
        average_gradients(opt)
        opt.grads_are_averaged()  # type: ignore[attr-defined]
        return True
    return False


def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Clip by the global gradient norm, the same on every rank.

    With expert parallelism each rank holds different experts: their squared norms are
    summed over the expert-parallel group so every rank computes the same total.
    """
    dense, expert = [], []
    for p in model.parameters():
        if p.grad is not None:
            (expert if is_expert_param(p) else dense).append(p.grad)
    sq = torch.zeros((), dtype=torch.float32)
    for g in dense:
        sq += g.float().pow(2).sum()
    if expert:
        esq = torch.zeros((), dtype=torch.float32)
        for g in expert:
            esq += g.float().pow(2).sum()
        ep = getattr(model, "ep_groups", None)
        if ep is not None:  # its ep_group None means the whole world
            dist.all_reduce(esq, group=ep.ep_group)
        sq += esq
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in dense + expert:
            g.mul_(coef)
    return norm


def any_rank(flag: bool, local_grads: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether any rank of ``group`` (default: the world) saw ``flag``: the step is skipped
    everywhere or nowhere.

    With exact gradient averaging a NaN on one rank reaches every rank's gradients, so
    the local check suffices; the 1-bit optimizers exchange no gradients, so they pay
    one 4-byte allreduce per step for the verdict.
    """
    if not local_grads or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    w = dist.get_world_size(group)
    stats.record("nan_check", stats.ring_allreduce_bytes(4, w), stats.ring_allreduce_bytes(4, w),
                 time.perf_counter() - t0)
    return bool(t.item() > 0)


def non_finite(loss: float, norm: float, averaged: bool,
               group: dist.ProcessGroup | None = None) -> bool:
    """The verdict of every rank of ``group`` (the ranks whose gradients are averaged
    together; default the world): was the loss or gradient NaN/inf on any of them?"""
    return any_rank(not (math.isfinite(loss) and math.isfinite(norm)), not averaged, group)


def nan_stop_reason(on_nan: str, streak: int, max_skips: int) -> str | None:
    """Why a non-finite step stops the run (None: skip it and go on)."""
    if on_nan == "stop":
        return "--on-nan stop"
    if streak > max_skips:
        return f"{streak} consecutive steps (max_nan_skips={max_skips})"
    return None


def report_freeze(emit: Callable[[dict[str, Any]], None], opt: torch.optim.Optimizer, step: int,
                  clipped_frac: float, rank: int) -> None:
    """Record the freeze, and warn when clipping was routine during the warm-up.

    Adam divides clipping's scale out again (m and sqrt(v) shrink alike). A frozen variance
    cannot: the momentum then comes from each rank's clipped local gradient, whose norm
    grows with gradient noise (more ranks, smaller batches), while v kept the scale of the
    clipped averages. So a clip that acts on most steps becomes a hidden learning-rate
    factor after the freeze (docs/optimizers.md: about 0.5x in our 2000-step run). A
    threshold that only catches spikes is safe.
    """
    emit({"kind": "freeze", "step": step, "optimizer": type(opt).__name__,
          "clipped_frac_before": clipped_frac})
    if clipped_frac > 0.5 and rank == 0:
        print(f"moebit: {type(opt).__name__} froze its variance after step {step}; gradient "
              f"clipping acted on {clipped_frac:.0%} of the steps before. With a frozen variance "
              "it now rescales every step (by each rank's local gradient norm): raise --grad-clip "
              "above the usual gradient norm or set it to 0. See docs/optimizers.md.",
              file=sys.stderr)
