"""Compressed collectives over any torch.distributed process group."""

from moebit.comm.bitpack import pack_signs, signs_weighted_sum, unpack_scaled, unpack_signs
from moebit.comm.compressed import OnebitAllreduce, padded_length
from moebit.comm.hooks import (
    FreezableAllreduceState,
    OnebitHookState,
    freezable_allreduce_hook,
    onebit_hook,
)

__all__ = [
    "FreezableAllreduceState",
    "OnebitAllreduce",
    "OnebitHookState",
    "freezable_allreduce_hook",
    "onebit_hook",
    "pack_signs",
    "padded_length",
    "signs_weighted_sum",
    "unpack_scaled",
    "unpack_signs",
]
