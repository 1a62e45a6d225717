"""An error-compensated 1-bit allreduce with one scale per block of elements.

    ar = BlockOnebitAllreduce(group, block=256)
    avg = ar.allreduce(flat, "fragment0")     # flat float32, the same length on every rank

Why a second 1-bit allreduce: ``moebit.comm.compressed.OnebitAllreduce`` gives each chunk
of a buffer (1/W of it) a single scale, which suits a gradient bucket of similar tensors
exchanged every step, where the error buffers average the error away within a few steps.
DiLoCo's pseudo-gradient is exchanged once every H steps and spans tensors whose scales
differ by orders of magnitude (an embedding row of a byte that never occurred is zero,
a LayerNorm gain drifts a little, an attention matrix a lot). Under one scale per chunk
every element moves by about the chunk's mean magnitude, and with a handful of syncs in
a run the error feedback has no time to cancel it. One scale per block of ``block``
consecutive elements (the mean absolute value of the block, the L2-optimal scale for
its signs) follows the magnitudes, for 4/``block`` bytes more per element (1/64 at 256).

The scheme is the two-phase one of 1-bit Adam (arXiv 2102.02888), per block:

1. worker: y = x + worker error; each block b gets scale m_b = mean |y_b|; the error
   y - m sign(y) stays for the next call;
2. all-to-all: rank r receives every rank's signs and scales of chunk r;
3. server r: z = mean over ranks of the decoded chunks + server error; z is compressed
   the same way and its error kept;
4. all-gather of the server chunks; every rank decodes the same average.

Bytes per rank: 2 (W-1)/W n (1/8 + 4/block). Traffic is recorded under
``<op_prefix>.phase1`` / ``.phase2`` in ``moebit.comm.stats``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moebit.comm import stats
from moebit.comm.bitpack import pack_signs, unpack_signs

DEFAULT_BLOCK = 256


@dataclass
class _Errors:
    n: int  # the caller's length
    worker: torch.Tensor  # [W * chunk]
    server: torch.Tensor  # [chunk]


def _compress(y: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed signs, per-block scales, error y - decoded) of a 1-D y of whole blocks."""
    scales = y.view(-1, block).abs().mean(1)
    packed = pack_signs(y)
    error = y - _decode(packed, scales, block)
    return packed, scales, error


def _decode(packed: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    n = scales.numel() * block
    return unpack_signs(packed, n).view(-1, block).mul_(scales.unsqueeze(1)).view(-1)


class BlockOnebitAllreduce:
    """Averages 1-D float32 tensors over ``group`` at about 1 bit per element, one scale
    per ``block`` elements, with worker and server error feedback per ``name``."""

    def __init__(self, group: dist.ProcessGroup | None = None, block: int = DEFAULT_BLOCK,
                 op_prefix: str = "onebit_blocks") -> None:
        if block < 8 or block % 8:
            raise ValueError(f"block must be a positive multiple of 8, got {block}")
        self.group, self.block, self.op_prefix = group, block, op_prefix
        initialized = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if initialized else 1
        self._errors: dict[str, _Errors] = {}

    def _chunk(self, n: int) -> int:
        """Elements of one rank's chunk: whole blocks, W chunks covering n."""
        per = self.world * self.block
        return -(-n // per) * self.block

    def _state(self, name: str, n: int) -> _Errors:
        err = self._errors.get(name)
        if err is None or err.n != n:
            c = self._chunk(n)
            err = _Errors(n, torch.zeros(self.world * c), torch.zeros(c))
            self._errors[name] = err
        return err

    def allreduce(self, x: torch.Tensor, name: str = "default") -> torch.Tensor:
        """The average of ``x`` (1-D float32, left unchanged) over the group, the same
        tensor on every rank."""
        if x.dim() != 1 or x.dtype != torch.float32:
            raise ValueError(f"BlockOnebitAllreduce takes a 1-D float32 tensor, got "
                             f"{x.dtype} of shape {tuple(x.shape)}")
        n, w, b = x.numel(), self.world, self.block
        err = self._state(name, n)
        c = err.server.numel()
        y = err.worker.clone()
        y[:n] += x
        packed, scales, err.worker = _compress(y, b)
        err.worker[n:] = 0  # padding carries no error into the blocks it shares
        if w == 1:
            z = _decode(packed, scales, b) + err.server
            packed, scales, err.server = _compress(z, b)
            return _decode(packed, scales, b)[:n]
        got_p, got_s = torch.empty_like(packed), torch.empty_like(scales)
        t0 = time.perf_counter()
        dist.all_to_all_single(got_p, packed, group=self.group)
        dist.all_to_all_single(got_s, scales, group=self.group)
        sent = (w - 1) * (c // 8 + 4 * (c // b))
        stats.record(f"{self.op_prefix}.phase1", sent, sent, time.perf_counter() - t0)
        mine = sum(_decode(got_p.view(w, -1)[r], got_s.view(w, -1)[r], b) for r in range(w))
        z = mine.div_(w).add_(err.server)
        sp, ss, err.server = _compress(z, b)
        all_p = torch.empty(w * sp.numel(), dtype=torch.uint8)
        all_s = torch.empty(w * ss.numel())
        t0 = time.perf_counter()
        dist.all_gather_single(all_p, sp, group=self.group)
        dist.all_gather_single(all_s, ss, group=self.group)
        stats.record(f"{self.op_prefix}.phase2", sent, sent, time.perf_counter() - t0)
        return _decode(all_p, all_s, b)[:n]

    def reset(self, name: str | None = None) -> None:
        """Drop the error buffers of ``name`` (all of them when None)."""
        if name is None:
            self._errors.clear()
        else:
            self._errors.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        """This rank's error buffers by name (every rank saves its own)."""
        return {"block": self.block,
                "buffers": {k: {"n": e.n, "worker_error": e.worker.clone(),
                                "server_error": e.server.clone()}
                            for k, e in self._errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("block") != self.block:
            raise ValueError(f"1-bit error buffers were saved with blocks of "
                             f"{state.get('block')} elements, this run uses {self.block}")
        self._errors = {}
        for k, e in state.get("buffers", {}).items():
            want = self.world * self._chunk(int(e["n"]))
            if e["worker_error"].numel() != want:
                raise ValueError(f"1-bit error buffer {k!r} holds {e['worker_error'].numel()} "
                                 f"elements, {want} expected at {self.world} ranks")
            self._errors[k] = _Errors(int(e["n"]), e["worker_error"].clone(),
                                      e["server_error"].clone())
