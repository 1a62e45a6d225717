"""Two ranks on CUDA for the cuda tests: NCCL where it can run, gloo on CUDA tensors always.

NCCL (since 2.5) refuses two ranks on one GPU ("Duplicate GPU detected", and its
maintainers say it would not work without the check), so with fewer GPUs than ranks the
NCCL case skips with that reason and the "gloo-cuda" case (the processes share GPU 0,
gloo moves the CUDA tensors) still runs every CUDA code path of the collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from moebit.testing import run_on_ranks

MODES = ("nccl", "gloo-cuda")


def rank_device(mode: str, rank: int) -> torch.device:
    """The device a body in ``mode`` ("cpu", "gloo-cuda" or "nccl") computes on."""
    if mode == "cpu":
        return torch.device("cpu")
    if mode == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", rank % torch.cuda.device_count())


def run_mode(fn: Callable[..., Any], mode: str, args: Sequence[Any] = (), world: int = 2,
             timeout: float = 120.0) -> list[Any]:
    """``fn(rank, world, mode, *args)`` on ``world`` ranks in ``mode``."""
    if mode == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs a GPU per rank ({world} ranks, {torch.cuda.device_count()} "
                    "GPU): it refuses two ranks on one GPU; the gloo-cuda case covers CUDA")
    backend = "nccl" if mode == "nccl" else "gloo"
    return run_on_ranks(fn, world, args=(mode, *args), timeout=timeout, backend=backend)


def mismatch_fraction(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float:
    """Share of elements outside the tolerance."""
    bad = (got.float() - want.float()).abs() > atol + rtol * want.float().abs()
    return float(bad.float().mean())


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||: one number for a whole tensor in a low precision."""
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-12))
