"""How DiLoCo's pseudo-gradients travel: fp32, bf16, int8 per block, or 1 bit with error
feedback. Each exchange averages a flat float32 tensor over the outer group and returns the
float32 average, identical on every rank of the group.

Traffic is recorded in ``moebit.comm.stats`` under names starting with ``outer.``, which is
the kind "outer" (``stats.kind_of``), so metrics show it apart from the inner optimizer's.

| compress | wire per element | error |
|---|---|---|
| ``none`` | 4 bytes (ring allreduce) | none |
| ``bf16`` | 2 bytes (ring allreduce in bf16) | bf16 rounding of each rank's value and of the partial sums |
| ``int8`` | 1 byte + 4 per block of 256 (two phases) | two roundings, each <= absmax_block/254 |
| ``1bit`` | 1/8 byte + 4 per ``onebit_block`` (two phases) | large, carried to the next sync |
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moebit.comm import collectives, stats
from moebit.comm.compressed import OnebitAllreduce
from moebit.comm.onebit_blocks import BlockOnebitAllreduce
from moebit.comm.quantize import DEFAULT_BLOCK, Int8Allreduce

__all__ = ["COMPRESSIONS", "Exchange", "make_exchange"]

COMPRESSIONS = ("none", "bf16", "int8", "1bit")


class Exchange(Protocol):
    """Averages one fragment's pseudo-gradient over the outer group."""

    def average(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The float32 average of the 1-D float32 ``flat`` (left unchanged) over the group."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FullExchange:
    """A plain allreduce in ``dtype`` (float32: exact up to summation order; bfloat16: half
    the bytes, rounded). Stateless."""

    def __init__(self, group: dist.ProcessGroup | None, dtype: torch.dtype, op: str) -> None:
        self.group, self.dtype, self.op = group, dtype, op
        self.world = collectives.world_size(group)

    def average(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        buf = flat.to(self.dtype, copy=True)
        if self.world > 1:
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=self.group, async_op=True).wait()
            moved = stats.ring_allreduce_bytes(buf.numel() * buf.element_size(), self.world)
            stats.record(self.op, moved, moved, time.perf_counter() - t0)
        out = buf.float() if self.dtype != torch.float32 else buf
        return out.div_(self.world) if self.world > 1 else out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Int8Exchange:
    """``moebit.comm.quantize.Int8Allreduce``: round to nearest, no error feedback."""

    def __init__(self, group: dist.ProcessGroup | None, block: int) -> None:
        self.impl = Int8Allreduce(group, block=block, op_prefix="outer.int8")

    def average(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return self.impl.allreduce(flat)

    def state_dict(self) -> dict[str, Any]:
        return {"block": self.impl.block}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("block", self.impl.block)
        if saved != self.impl.block:
            raise ValueError(f"outer optimizer state was saved with int8 blocks of {saved}, "
                             f"this run uses {self.impl.block} (outer_int8_block)")


class OnebitExchange:
    """An error-compensated 1-bit allreduce, one scale per ``block`` elements
    (``moebit.comm.onebit_blocks``; 0: one per chunk, ``moebit.comm.compressed``), one
    pair of error buffers per fragment, carried from one sync of that fragment to the next: what a
    sync's signs could not deliver is added to the next sync's pseudo-gradient, so the
    running sum of exchanged averages tracks the running sum of exact ones."""

    def __init__(self, group: dist.ProcessGroup | None, block: int = DEFAULT_BLOCK) -> None:
        self.block = block
        self.impl: OnebitAllreduce | BlockOnebitAllreduce = (
            BlockOnebitAllreduce(group, block, op_prefix="outer.onebit") if block
            else OnebitAllreduce(group=group, op_prefix="outer.onebit"))

    def average(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return self.impl.allreduce(flat, name=name)

    def state_dict(self) -> dict[str, Any]:
        return {"onebit_block": self.block, "errors": self.impl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        saved = state.get("onebit_block", 0)  # checkpoints from before block scales: chunks
        if saved != self.block:
            raise ValueError(f"outer optimizer state was saved with 1-bit scales per "
                             f"{saved or 'chunk'} elements, this run uses "
                             f"{self.block or 'chunk'} (outer_onebit_block)")
        self.impl.load_state_dict(state["errors"] if "errors" in state else state)


def make_exchange(compress: str, group: dist.ProcessGroup | None,
                  int8_block: int = DEFAULT_BLOCK, onebit_block: int = DEFAULT_BLOCK) -> Exchange:
    """The exchange for ``compress`` (one of ``COMPRESSIONS``) over ``group``."""
    if compress == "none":
        return FullExchange(group, torch.float32, "outer.fp32")
    if compress == "bf16":
        return FullExchange(group, torch.bfloat16, "outer.bf16")
    if compress == "int8":
        return Int8Exchange(group, int8_block)
    if compress == "1bit":
        return OnebitExchange(group, onebit_block)
    raise ValueError(f"invalid outer_compress {compress!r}: expected one of {', '.join(COMPRESSIONS)}")
