"""Optimizers that exchange 1-bit momentum instead of gradients, and how to build them.

Training-loop contract: an optimizer with ``averages_gradients = True`` averages the
gradients (or momenta) over each param group's process group itself, so the loop only
calls ``backward()``, optionally clips the local gradients, then ``step()``. Such an
optimizer also exposes ``comm_stage`` ("warmup" / "compressed") and ``frozen_at``.
"""

from moebit.optim.build import (
    build_optimizer,
    optimizer_from_deepspeed_config,
    optimizer_names,
    register_optimizer,
)
from moebit.optim.freeze import AutoFreeze
from moebit.optim.onebit_adam import OnebitAdam

__all__ = [
    "AutoFreeze",
    "OnebitAdam",
    "build_optimizer",
    "optimizer_from_deepspeed_config",
    "optimizer_names",
    "register_optimizer",
]
