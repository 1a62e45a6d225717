"""Optimizers that exchange 1-bit momentum instead of gradients, and how to build them.

Training-loop contract: an optimizer with ``averages_gradients = True`` averages the
gradients (or momenta) over each param group's process group itself, so the loop only
calls ``backward()``, optionally clips the local gradients, then ``step()``. Such an
optimizer also exposes ``comm_stage`` ("warmup" / "compressed"; 0/1 Adam: "variance" /
"local") and ``frozen_at``. ``Lamb`` (exact LAMB) behaves like torch's Adam: the loop
averages its gradients.

Low-communication training (DiLoCo, Streaming DiLoCo) wraps any of them in an
``OuterOptimizer``: the loop calls ``outer.step()`` after each inner ``opt.step()``
(docs/low-communication.md).
"""

from moebit.optim.base import CompressedOptimizer
from moebit.optim.build import (
    EXACT_OPTIMIZERS,
    OUTER_COMPRESSIONS,
    OUTER_KEYS,
    OptimizerSettings,
    build_optimizer,
    build_outer_optimizer,
    optimizer_from_deepspeed_config,
    optimizer_names,
    register_optimizer,
)
from moebit.optim.freeze import AutoFreeze
from moebit.optim.lamb import Lamb
from moebit.optim.onebit_adam import OnebitAdam
from moebit.optim.onebit_lamb import OnebitLamb
from moebit.optim.outer import OuterOptimizer, SyncRecord, module_blocks
from moebit.optim.outer_params import OuterSettings
from moebit.optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "EXACT_OPTIMIZERS",
    "AutoFreeze",
    "CompressedOptimizer",
    "Lamb",
    "OnebitAdam",
    "OnebitLamb",
    "OUTER_COMPRESSIONS",
    "OUTER_KEYS",
    "OptimizerSettings",
    "OuterOptimizer",
    "OuterSettings",
    "SyncRecord",
    "ZeroOneAdam",
    "build_optimizer",
    "build_outer_optimizer",
    "module_blocks",
    "optimizer_from_deepspeed_config",
    "optimizer_names",
    "register_optimizer",
]
