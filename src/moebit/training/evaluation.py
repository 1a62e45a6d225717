"""Validation loss of a model on fixed batches: the one evaluation loop of training,
distillation (teacher, catch-up checks) and ``moebit eval``."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def autocast(dtype: str, device: torch.device) -> torch.autocast:
    """bf16 autocast when ``dtype`` is "bf16", a no-op context otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], dtype: str,
             device: torch.device) -> float:
    """Mean validation loss in nats per byte over all windows (every rank computes the same
    number); batches may differ in size, e.g. the last one of ``moebit eval``'s split.

    The model is evaluated in eval mode and handed back in the mode it came in, so a frozen
    teacher stays in eval mode and a training model goes on training.
    """
    was_training = model.training
    model.eval()
    total, windows = 0.0, 0
    try:
        for x, y in batches:
            with autocast(dtype, device):
                total += float(model(x.to(device), y.to(device)).loss) * len(x)
            windows += len(x)
    finally:
        model.train(was_training)
    if not windows:
        raise ValueError("evaluate: no validation batches")
    return total / windows
