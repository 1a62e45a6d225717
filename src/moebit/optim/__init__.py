"""Optimizers that exchange 1-bit momentum instead of gradients, and how to build them.

Training-loop contract: an optimizer with ``averages_gradients = True`` averages the
gradients (or momenta) over each param group's process group itself, so the loop only
calls ``backward()``, optionally clips the local gradients, then ``step()``. Such an
optimizer also exposes ``comm_stage`` ("warmup" / "compressed"; 0/1 Adam: "variance" /
"local") and ``frozen_at``. ``Lamb`` (exact LAMB) behaves like torch's Adam: the loop
averages its gradients.
"""

from moebit.optim.base import CompressedOptimizer
from moebit.optim.build import (
    EXACT_OPTIMIZERS,
    OptimizerSettings,
    build_optimizer,
    optimizer_from_deepspeed_config,
    optimizer_names,
    register_optimizer,
)
from moebit.optim.freeze import AutoFreeze
from moebit.optim.lamb import Lamb
from moebit.optim.onebit_adam import OnebitAdam
from moebit.optim.onebit_lamb import OnebitLamb
from moebit.optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "EXACT_OPTIMIZERS",
    "AutoFreeze",
    "CompressedOptimizer",
    "Lamb",
    "OnebitAdam",
    "OnebitLamb",
    "OptimizerSettings",
    "ZeroOneAdam",
    "build_optimizer",
    "optimizer_from_deepspeed_config",
    "optimizer_names",
    "register_optimizer",
]
