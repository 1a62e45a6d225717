"""Tiny deterministic problems for testing optimizers and training loops, on one rank or many.

Each rank draws different data (the seed includes the rank), so a distributed optimizer
that fails to exchange what it should leaves the replicas apart instead of passing by
luck; every model starts from the same seed on every rank, as a real run does.

    model = regression_mlp()
    opt = MyOptimizer(model.parameters())
    losses = fit(model, opt, rank, range(50))   # 50 steps on this rank's own batches
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moebit.comm import collectives
from moebit.comm.collectives import DistInfo
from moebit.models import gpt
from moebit.training.config import build
from moebit.training.data import TrainBatches
from moebit.training.state import save


def regression_mlp(seed: int = 0, n_in: int = 10, hidden: int = 32) -> nn.Module:
    """A 2-layer tanh MLP with one output, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def regression_batch(rank: int, step: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of a noisy non-linear target of 10 inputs; different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(rows, 10, generator=g)
    y = x[:, :3].sum(1, keepdim=True) - x[:, 5:6] * x[:, 6:7] + 0.1 * torch.randn(rows, 1, generator=g)
    return x, y


def sum_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A noiseless batch of 6 inputs whose target is the sum of the first two; the same on
    every rank (for single-process tests that compare optimizers bit for bit)."""
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step))
    return x, x[:, :2].sum(1, keepdim=True)


def fit(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: Iterable[int],
        average: bool = False, sched: Any = None,
        batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] = regression_batch,
        ) -> list[float]:
    """One optimizer step on the mean squared error of ``batch(rank, t)`` for each t in
    ``steps``; returns the losses.

    ``average`` allreduces the gradients first (what plain data-parallel Adam needs; the
    1-bit optimizers exchange their own state instead). ``sched`` steps after each step.
    """
    losses = []
    for t in steps:
        x, y = batch(rank, t)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if average:
            collectives.allreduce_mean_([p.grad for p in model.parameters()])
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def held_out_loss(model: nn.Module) -> float:
    """The loss on one batch no rank trains on, the same batch on every rank."""
    x, y = regression_batch(rank=7, step=10_000)
    with torch.no_grad():
        return ((model(x) - y) ** 2).mean().item()


def flat_params(model: nn.Module) -> torch.Tensor:
    """A copy of all parameters as one vector, for bit-exact comparisons."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def poison_gpt_loss(rank: int, on_rank: int, at_call: int) -> None:
    """Make ``GPT``'s training loss NaN on rank ``on_rank`` at its ``at_call``-th training
    forward (1-based), in this process only: the fault the NaN policies must survive."""
    original = gpt.GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, cache=None, **kw):  # type: ignore[no-untyped-def]
        out = original(self, idx, targets, cache, **kw)
        if self.training and targets is not None:
            calls["n"] += 1
            if rank == on_rank and calls["n"] == at_call:
                out.loss = out.loss * float("nan")
        return out

    gpt.GPT.forward = poisoned  # type: ignore[method-assign]


def save_run(run: Path, settings: dict[str, Any], step: int = 1) -> gpt.GPT:
    """A run folder holding one checkpoint (at ``step``) of a random model built from the
    training ``settings``, as moebit train saves it; returns the model in eval mode."""
    cfg = build({"samples": 0, **settings, "run_dir": str(run)})
    torch.manual_seed(0)
    model = gpt.GPT(cfg.model_config())
    opt = torch.optim.Adam(model.parameters())
    batches = TrainBatches(np.arange(1000, dtype=np.uint8), 32, 2, 0, 0)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    save(run, step, model, opt, batches, DistInfo(0, 1, 0, torch.device("cpu"), None), cfg,
         wall=0.0, train_time=0.0)
    return model.eval()
