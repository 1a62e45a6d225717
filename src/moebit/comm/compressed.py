"""Error-compensated 1-bit allreduce over any torch.distributed process group.

The two-phase scheme of 1-bit Adam (DESIGN.md section 3), with worker and server error
feedback, using only ``all_to_all_single`` and ``all_gather`` so it runs on gloo (CPU),
NCCL (GPU) and MPI alike:

1. every rank checks that all ranks pass the same length (an 8-byte all_gather: a mismatch
   is an error on every rank instead of a hang or silent garbage);
2. worker: y = x + worker_error, scale = ||y|| / sqrt(n), signs packed 8 to a byte, the
   buffer cut into W chunks; each chunk travels with the 4-byte scale appended, so the
   all_to_all carries the scales too (one collective instead of two);
3. server r (chunk r): decodes sum_i (scale_i / W) * sign_i, adds its server error,
   recompresses with its own scale;
4. an all_gather of the packed server chunks (scale appended), and every rank decodes the
   same average.

Bytes on the wire per rank: 2*(W-1)/W * n/8 plus 8*(W-1) bytes of scales and 8*(W-1) of
length check, against 2*(W-1)/W * 4n for a ring fp32 allreduce.

Error buffers are float32, one pair per ``name`` and per rank: they hold what compression
has not yet delivered, so the running sum of outputs tracks the running sum of exact
averages. They are stored implicitly as the last compressor input and its scale
(error = y - scale*sign(y)), which saves a pass over memory; ``state_dict`` materialises
them. A non-finite input (NaN/inf) gives a non-finite output on every rank, as an exact
allreduce would (so AMP loss scalers see it), and the error buffers it touched restart
from zero instead of staying poisoned.

World size 1 still compresses, with the same error feedback and no communication, so a
single-process run of an optimizer built on this behaves like its multi-rank runs.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moebit import distributed as mdist  # a module import: moebit.distributed imports comm.stats
from moebit.comm import stats
from moebit.comm.bitpack import feedback_error, feedback_step_, server_step_, unpack_scaled

__all__ = ["OnebitAllreduce", "padded_length"]


def padded_length(n: int, world: int) -> int:
    """n rounded up to a multiple of 8*world (at least one byte per chunk)."""
    step = 8 * world
    return max(1, -(-n // step)) * step


@dataclass
class _Buffers:
    """Error-feedback state and reusable scratch for one named buffer on one rank."""

    n: int
    chunk: int  # elements per chunk (padded)
    y: torch.Tensor  # worker: last compressor input, float32 [n]
    ys: float  # worker: the scale it was compressed with
    z: torch.Tensor  # server: last compressor input for this rank's chunk, float32
    zs: float
    send: torch.Tensor  # [W, chunk/8 + 4] uint8: packed chunks, each with its scale appended
    recv: torch.Tensor
    send2: torch.Tensor  # [chunk/8 + 4]
    recv2: torch.Tensor  # [W, chunk/8 + 4]
    x32: torch.Tensor | None = None  # float32 copy of a non-float32 / non-contiguous input
    out32: torch.Tensor | None = None  # float32 result before casting to the input dtype


class OnebitAllreduce:
    """Averages float tensors over ``group`` sending about 1 bit per element.

    >>> ar = OnebitAllreduce()              # default group, or world size 1 without one
    >>> avg = ar.allreduce(grad, "bucket0")  # same shape and dtype as grad

    ``name`` selects the pair of error buffers, so one object serves many buffers; a
    buffer must be passed with the same length on every rank and on every call (a new
    length resets that name's error buffers with a warning).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if isinstance(group, int) and group == getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
            raise ValueError(
                "this rank is not a member of the given group (dist.new_group returned "
                "NON_GROUP_MEMBER here): only the group's ranks may create its 1-bit allreduce"
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                "group must be a torch.distributed.ProcessGroup or None, got "
                f"{type(group).__name__}; build one with torch.distributed.new_group(ranks)"
            )
        initialized = dist.is_available() and dist.is_initialized()
        if group is not None and not initialized:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        self.group = group
        self.world = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        if self.rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given group"
            )
        self.backend = dist.get_backend(group) if initialized else None
        self._bufs: dict[str, _Buffers] = {}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's error buffers (every rank must save its own), materialised as tensors."""
        buffers = {
            name: {
                "n": b.n,
                "worker_error": feedback_error(b.y, b.ys).cpu(),
                "server_error": feedback_error(b.z, b.zs).cpu(),
            }
            for name, b in self._bufs.items()
        }
        return {"world_size": self.world, "rank": self.rank, "buffers": buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore error buffers saved by this rank; from another world size or rank, reset."""
        if state.get("world_size") != self.world or state.get("rank") != self.rank:
            warnings.warn(
                f"1-bit allreduce state saved by rank {state.get('rank')} of "
                f"{state.get('world_size')} cannot be used by rank {self.rank} of {self.world} "
                "(the server errors belong to other chunks): error buffers start from zero",
                UserWarning,
                stacklevel=2,
            )
            self._bufs.clear()
            return
        self._bufs.clear()
        for name, b in state["buffers"].items():
            dev = b["worker_error"].device
            bufs = self._new_buffers(int(b["n"]), dev)
            bufs.y.copy_(b["worker_error"])
            bufs.z.copy_(b["server_error"])
            self._bufs[name] = bufs

    def reset(self, name: str | None = None) -> None:
        """Zero the error buffers of ``name``, or of every name."""
        for key, b in self._bufs.items():
            if name is None or key == name:
                b.y.zero_()
                b.z.zero_()
                b.ys = b.zs = 0.0

    def names(self) -> list[str]:
        return list(self._bufs)

    # ------------------------------------------------------------------ the allreduce

    def allreduce(
        self, tensor: torch.Tensor, name: str = "default", out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The average of ``tensor`` over the group, 1-bit compressed with error feedback.

        Returns a new tensor of the same shape and dtype, or writes into ``out`` (which may
        be ``tensor`` itself) when given: reusing an output buffer avoids the page faults of
        a fresh allocation, which cost as much as the packing on CPU.
        """
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"1-bit allreduce needs a floating-point tensor, got {got}")
        if self.backend == "nccl" and tensor.device.type != "cuda":
            raise ValueError("the group uses NCCL, which needs CUDA tensors; got a CPU tensor")
        if out is not None and (out.shape != tensor.shape or out.dtype != tensor.dtype):
            raise ValueError("out must have the shape and dtype of tensor")
        n, w = tensor.numel(), self.world
        self._check_lengths(n, tensor.device, name)
        b = self._buffers(name, n, tensor.device)
        x = tensor.reshape(-1)
        if x.dtype != torch.float32 or not x.is_contiguous():
            if b.x32 is None:
                b.x32 = torch.empty(n, dtype=torch.float32, device=tensor.device)
            b.x32.copy_(x)
            x = b.x32
        m, cb = b.chunk, b.chunk // 8

        t0 = time.perf_counter()
        if not math.isfinite(b.ys):
            b.y.zero_()
            b.ys = 0.0
        sumsq = 0.0
        for r in range(w):
            lo, hi = r * m, min(n, (r + 1) * m)
            if hi > lo:
                sumsq += feedback_step_(x[lo:hi], b.y[lo:hi], b.ys, b.send[r, :cb])
        b.ys = math.sqrt(sumsq / n) if n else 0.0
        b.send[:, cb:].copy_(_scale_bytes(b.ys, tensor.device))
        stats.add_time("onebit.pack", time.perf_counter() - t0)

        t0 = time.perf_counter()
        if w > 1:
            dist.all_to_all_single(b.recv.view(-1), b.send.view(-1), group=self.group)
        else:
            b.recv.copy_(b.send)
        moved = (w - 1) * (cb + 4)
        stats.record("onebit.phase1", moved, moved, time.perf_counter() - t0)

        t0 = time.perf_counter()
        scales = [s / w for s in _read_scales(b.recv, cb)]
        valid = max(0, min(m, n - self.rank * m))
        if not math.isfinite(b.zs):
            b.z.zero_()
            b.zs = 0.0
        zsq = server_step_(b.recv, scales, valid, b.z, b.zs, b.send2[:cb])
        b.zs = math.sqrt(zsq / valid) if valid else 0.0
        b.send2[cb:].copy_(_scale_bytes(b.zs, tensor.device))
        stats.add_time("onebit.pack", time.perf_counter() - t0)

        t0 = time.perf_counter()
        if w > 1:
            mdist.all_gather_flat(b.recv2.view(-1), b.send2, group=self.group)
        else:
            b.recv2[0].copy_(b.send2)
        stats.record("onebit.phase2", moved, moved, time.perf_counter() - t0)

        t0 = time.perf_counter()
        result = self._decode(b, tensor, out)
        stats.add_time("onebit.unpack", time.perf_counter() - t0)
        return result

    # ------------------------------------------------------------------ helpers

    def _decode(
        self, b: _Buffers, tensor: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        n, m, cb = b.n, b.chunk, b.chunk // 8
        if out is None:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        direct = out.dtype == torch.float32 and out.is_contiguous()
        if direct:
            flat = out.view(-1)
        else:
            if b.out32 is None:
                b.out32 = torch.empty(n, dtype=torch.float32, device=tensor.device)
            flat = b.out32
        for r, s in enumerate(_read_scales(b.recv2, cb)):
            lo, hi = r * m, min(n, (r + 1) * m)
            if hi > lo:
                unpack_scaled(b.recv2[r, :cb], hi - lo, s, flat[lo:hi])
        if not direct:
            out.copy_(flat.view(out.shape))
        return out

    def _check_lengths(self, n: int, device: torch.device, name: str) -> None:
        if self.world == 1:
            return
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        every = torch.empty(self.world, dtype=torch.int64, device=device)
        t0 = time.perf_counter()
        mdist.all_gather_flat(every, mine, group=self.group)
        moved = 8 * (self.world - 1)
        stats.record("onebit.header", moved, moved, time.perf_counter() - t0)
        lengths = every.tolist()
        if any(v != n for v in lengths):
            raise ValueError(
                f"1-bit allreduce of {name!r}: ranks passed tensors of different lengths "
                f"{lengths} (by rank in the group); every rank must pass the same number "
                "of elements"
            )

    def _buffers(self, name: str, n: int, device: torch.device) -> _Buffers:
        b = self._bufs.get(name)
        if b is not None and b.n != n:
            warnings.warn(
                f"1-bit allreduce {name!r}: length changed from {b.n} to {n}; "
                "its error buffers start from zero",
                UserWarning,
                stacklevel=3,
            )
            b = None
        if b is not None and b.y.device != device:
            old = b
            b = self._new_buffers(n, device)
            b.y.copy_(old.y)
            b.z.copy_(old.z)
            b.ys, b.zs = old.ys, old.zs
        if b is None:
            b = self._new_buffers(n, device)
        self._bufs[name] = b
        return b

    def _new_buffers(self, n: int, device: torch.device) -> _Buffers:
        w = self.world
        m = padded_length(n, w) // w
        cb = m // 8
        valid = max(0, min(m, n - self.rank * m))

        def u8(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.uint8, device=device)

        return _Buffers(
            n=n,
            chunk=m,
            y=torch.zeros(n, dtype=torch.float32, device=device),
            ys=0.0,
            z=torch.zeros(valid, dtype=torch.float32, device=device),
            zs=0.0,
            send=u8(w, cb + 4),
            recv=u8(w, cb + 4),
            send2=u8(cb + 4),
            recv2=u8(w, cb + 4),
        )


def _scale_bytes(s: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([s], dtype=torch.float32).view(torch.uint8).to(device)


def _read_scales(rows: torch.Tensor, cb: int) -> list[float]:
    """The float32 scale appended after the ``cb`` packed bytes of each row."""
    tail = torch.empty((rows.shape[0], 4), dtype=torch.uint8, device=rows.device)
    tail.copy_(rows[:, cb:])
    return tail.view(torch.float32).reshape(-1).cpu().tolist()
