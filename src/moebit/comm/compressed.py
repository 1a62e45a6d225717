"""Error-compensated 1-bit allreduce over any torch.distributed process group.

The two-phase scheme of 1-bit Adam (docs/optimizers.md), with worker and server error
feedback, using only ``all_to_all_single`` and ``all_gather`` so it runs on gloo (CPU),
NCCL (GPU) and MPI alike:

1. every rank checks that all ranks pass the same length (an 8-byte all_gather: a mismatch
   is an error on every rank instead of a hang or silent garbage);
2. worker: y = x + worker_error, cut into W chunks; each chunk gets its scale
   ||y_chunk|| / sqrt(len) and its signs packed 8 to a byte, and travels with its 4-byte
   scale appended, so one all_to_all carries signs and scales;
3. server r (chunk r): decodes sum_i (scale_i / W) * sign_i, adds its server error,
   recompresses with its own scale;
4. the packed server chunks (scale appended) go to every rank, and every rank decodes the
   same average. This is an all_gather's traffic, sent as an all_to_all because that one
   can run asynchronously (below).

Long buffers are cut into segments (``segment_elements``, 4M by default) that flow through
these steps as a software pipeline: segment k is packed while k-1 is in phase 1 and k-2 in
phase 2, so on a slow link the packing hides behind the transfer. Per-chunk scales (rather
than one per rank) cost no extra bytes and shrink the compression error.

Bytes on the wire per rank: 2*(W-1)/W * n/8, plus 8*(W-1) bytes of scales per segment and
8*(W-1) for the length check, against 2*(W-1)/W * 4n for a ring fp32 allreduce.

Error buffers are float32, one pair per ``name`` and per rank: they hold what compression
has not yet delivered, so the running sum of outputs tracks the running sum of exact
averages. They are stored implicitly as the last compressor input and its scale
(error = y - scale*sign(y)), which saves a pass over memory; ``state_dict`` materialises
them. A non-finite input (NaN/inf) gives a non-finite output for the chunks it touches on
every rank, as an exact allreduce would (so AMP loss scalers see it), and the error buffers
it touched restart from zero instead of staying poisoned.

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

from moebit.comm import collectives, stats
from moebit.comm.bitpack import empty_fast, feedback_error, feedback_step_, server_step_, unpack_scaled

__all__ = ["OnebitAllreduce", "padded_length"]


def padded_length(n: int, world: int) -> int:
    """n rounded up to a multiple of 8*world (at least one byte per chunk)."""
    step = 8 * world
    return max(1, -(-n // step)) * step


DEFAULT_SEGMENT = 1 << 22  # elements: 4M float32 = 16 MiB in, 512 KiB packed out


@dataclass
class _Segment:
    """One pipelined piece of a buffer: its scales, server error and wire buffers."""

    off: int  # first element in the flat buffer
    length: int
    chunk: int  # elements per chunk, padded: W chunks cover the segment
    ys: list[float]  # worker scale of each chunk (error = y - ys*sign(y) there)
    z: torch.Tensor  # server: last compressor input of this rank's chunk, float32
    zs: float
    send: torch.Tensor  # [W, chunk/8 + 4] uint8: packed chunks, each with its scale appended
    recv: torch.Tensor
    send2: torch.Tensor  # [W, chunk/8 + 4]: this rank's server chunk, once per peer
    recv2: torch.Tensor  # [W, chunk/8 + 4]: every server chunk

    def chunk_range(self, r: int) -> tuple[int, int]:
        """Element range of chunk r within the segment (possibly empty, for padding)."""
        lo = min(self.length, r * self.chunk)
        return lo, min(self.length, lo + self.chunk)


@dataclass
class _Buffers:
    """Error-feedback state and reusable scratch for one named buffer on one rank."""

    n: int
    y: torch.Tensor  # worker: last compressor input, float32 [n]
    segments: list[_Segment]
    x32: torch.Tensor | None = None  # float32 copy of a non-float32 / non-contiguous input
    out32: torch.Tensor | None = None  # float32 result before casting to the input dtype


class OnebitAllreduce:
    """Averages float tensors over ``group`` sending about 1 bit per element.

    >>> ar = OnebitAllreduce()              # default group, or world size 1 without one
    >>> avg = ar.allreduce(grad, "bucket0")  # same shape and dtype as grad

    ``name`` selects the pair of error buffers, so one object serves many buffers; a
    buffer must be passed with the same length on every rank and on every call (a new
    length resets that name's error buffers with a warning).

    ``segment_elements``: buffers longer than this are cut into segments that go through
    the two phases as a pipeline (packing segment k+1 while segment k is on the wire);
    each chunk of each segment carries its own scale. Every rank must use the same value.

    ``op_prefix`` names this object's traffic in ``moebit.comm.stats`` (``onebit.phase1``
    ...): DiLoCo's outer exchange passes ``"outer.onebit"`` so its bytes count as kind
    "outer", apart from a 1-bit inner optimizer's.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, segment_elements: int = DEFAULT_SEGMENT,
        op_prefix: str = "onebit",
    ) -> None:
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
        if segment_elements < 8:
            raise ValueError(f"segment_elements must be at least 8, got {segment_elements}")
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
        self.segment_elements = segment_elements
        self.op_prefix = op_prefix
        self._bufs: dict[str, _Buffers] = {}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's error buffers (every rank must save its own), materialised as tensors."""
        buffers = {}
        for name, b in self._bufs.items():
            worker = torch.empty_like(b.y)
            for seg in b.segments:
                for r, s in enumerate(seg.ys):
                    lo, hi = seg.chunk_range(r)
                    sl = slice(seg.off + lo, seg.off + hi)
                    worker[sl] = feedback_error(b.y[sl], s)
            server = [feedback_error(seg.z, seg.zs).cpu() for seg in b.segments]
            buffers[name] = {"n": b.n, "worker_error": worker.cpu(), "server_error": server}
        return {
            "world_size": self.world,
            "rank": self.rank,
            "segment_elements": self.segment_elements,
            "buffers": buffers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore error buffers saved by this rank; from another world size or rank, reset."""
        saved = (state.get("world_size"), state.get("rank"), state.get("segment_elements"))
        if saved != (self.world, self.rank, self.segment_elements):
            warnings.warn(
                f"1-bit allreduce state saved by rank {saved[1]} of {saved[0]} (segments of "
                f"{saved[2]}) cannot be used by rank {self.rank} of {self.world} (segments of "
                f"{self.segment_elements}): the server errors belong to other chunks, so the "
                "error buffers start from zero",
                UserWarning,
                stacklevel=2,
            )
            self._bufs.clear()
            return
        self._bufs.clear()
        for name, saved_b in state["buffers"].items():
            b = self._new_buffers(int(saved_b["n"]), saved_b["worker_error"].device)
            b.y.copy_(saved_b["worker_error"])  # with scale 0, y is exactly the error
            for seg, z in zip(b.segments, saved_b["server_error"], strict=True):
                seg.z.copy_(z)
            self._bufs[name] = b

    def reset(self, name: str | None = None) -> None:
        """Zero the error buffers of ``name``, or of every name."""
        for key, b in self._bufs.items():
            if name is None or key == name:
                b.y.zero_()
                for seg in b.segments:
                    seg.ys = [0.0] * self.world
                    seg.z.zero_()
                    seg.zs = 0.0

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
        n = tensor.numel()
        self._check_lengths(n, tensor.device, name)
        b = self._buffers(name, n, tensor.device)
        x = tensor.reshape(-1)
        if x.dtype != torch.float32 or not x.is_contiguous():
            if b.x32 is None:
                b.x32 = torch.empty(n, dtype=torch.float32, device=tensor.device)
            b.x32.copy_(x)
            x = b.x32
        if out is None:
            out = empty_fast(n, tensor.dtype, tensor.device).view(tensor.shape)
        direct = out.dtype == torch.float32 and out.is_contiguous()
        if direct:
            flat = out.view(-1)
        else:
            if b.out32 is None:
                b.out32 = torch.empty(n, dtype=torch.float32, device=tensor.device)
            flat = b.out32

        # Software pipeline: segment k is packed while k-1 is in phase 1 and k-2 in phase 2.
        segs = b.segments
        phase1: list[Any] = [None] * len(segs)
        phase2: list[Any] = [None] * len(segs)
        for k in range(len(segs) + 2):
            if k < len(segs):
                self._worker(b, segs[k], x)
                phase1[k] = self._exchange(segs[k].send, segs[k].recv)
            if 0 <= k - 1 < len(segs):
                self._wait(phase1[k - 1], f"{self.op_prefix}.phase1", segs[k - 1])
                self._server(segs[k - 1])
                phase2[k - 1] = self._exchange(segs[k - 1].send2, segs[k - 1].recv2)
            if 0 <= k - 2 < len(segs):
                self._wait(phase2[k - 2], f"{self.op_prefix}.phase2", segs[k - 2])
                self._decode(segs[k - 2], flat)
        if not direct:
            out.copy_(flat.view(out.shape))
        return out

    # ------------------------------------------------------------------ the steps

    def _worker(self, b: _Buffers, seg: _Segment, x: torch.Tensor) -> None:
        """y <- x + worker error, chunk by chunk; packs each chunk with its scale appended."""
        t0 = time.perf_counter()
        cb = seg.chunk // 8
        for r in range(self.world):
            lo, hi = seg.chunk_range(r)
            if hi == lo:
                seg.ys[r] = 0.0
                seg.send[r, cb:].copy_(_scale_bytes(0.0, seg.send.device))
                continue
            sl = slice(seg.off + lo, seg.off + hi)
            if not math.isfinite(seg.ys[r]):  # a NaN/inf input last time: restart clean
                b.y[sl].zero_()
                seg.ys[r] = 0.0
            sumsq = feedback_step_(x[sl], b.y[sl], seg.ys[r], seg.send[r, :cb])
            seg.ys[r] = math.sqrt(sumsq / (hi - lo))
            seg.send[r, cb:].copy_(_scale_bytes(seg.ys[r], seg.send.device))
        stats.add_time(f"{self.op_prefix}.pack", time.perf_counter() - t0)

    def _server(self, seg: _Segment) -> None:
        """Decode sum_i scale_i/W * sign_i of this rank's chunk, add the server error, pack."""
        t0 = time.perf_counter()
        w, cb = self.world, seg.chunk // 8
        scales = [s / w for s in _read_scales(seg.recv, cb)]
        lo, hi = seg.chunk_range(self.rank)
        if not math.isfinite(seg.zs):
            seg.z.zero_()
            seg.zs = 0.0
        zsq = server_step_(seg.recv, scales, hi - lo, seg.z, seg.zs, seg.send2[0, :cb])
        seg.zs = math.sqrt(zsq / (hi - lo)) if hi > lo else 0.0
        seg.send2[0, cb:].copy_(_scale_bytes(seg.zs, seg.send2.device))
        if w > 1:
            seg.send2[1:].copy_(seg.send2[0])  # an all_gather, sent as an all_to_all
        stats.add_time(f"{self.op_prefix}.pack", time.perf_counter() - t0)

    def _decode(self, seg: _Segment, flat: torch.Tensor) -> None:
        t0 = time.perf_counter()
        cb = seg.chunk // 8
        for r, s in enumerate(_read_scales(seg.recv2, cb)):
            lo, hi = seg.chunk_range(r)
            if hi > lo:
                unpack_scaled(seg.recv2[r, :cb], hi - lo, s, flat[seg.off + lo : seg.off + hi])
        stats.add_time(f"{self.op_prefix}.unpack", time.perf_counter() - t0)

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> tuple[Any, float]:
        """Start an all_to_all of the rows of ``send`` (row r goes to rank r)."""
        t0 = time.perf_counter()
        if self.world == 1:
            recv.copy_(send)
            return None, time.perf_counter() - t0
        work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group,
                                      async_op=True)
        return work, time.perf_counter() - t0

    def _wait(self, pending: tuple[Any, float], op: str, seg: _Segment) -> None:
        """Finish a started exchange; the time counted is what this rank spent blocked."""
        work, spent = pending
        t0 = time.perf_counter()
        if work is not None:
            work.wait()
        moved = (self.world - 1) * (seg.chunk // 8 + 4)
        stats.record(op, moved, moved, spent + time.perf_counter() - t0)

    # ------------------------------------------------------------------ helpers

    def _check_lengths(self, n: int, device: torch.device, name: str) -> None:
        if self.world == 1:
            return
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        every = torch.empty(self.world, dtype=torch.int64, device=device)
        t0 = time.perf_counter()
        collectives.all_gather_flat(every, mine, group=self.group)
        moved = 8 * (self.world - 1)
        stats.record(f"{self.op_prefix}.header", moved, moved, time.perf_counter() - t0)
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
            old, b = b, self._new_buffers(n, device)
            b.y.copy_(old.y)
            for new_seg, old_seg in zip(b.segments, old.segments, strict=True):
                new_seg.z.copy_(old_seg.z)
                new_seg.ys, new_seg.zs = old_seg.ys, old_seg.zs
        if b is None:
            b = self._new_buffers(n, device)
        self._bufs[name] = b
        return b

    def _new_buffers(self, n: int, device: torch.device) -> _Buffers:
        w = self.world
        count = max(1, -(-n // self.segment_elements))
        seg_len = padded_length(-(-n // count), w)  # equal segments, the last one shorter
        segments = []
        for off in range(0, max(n, 1), seg_len):
            length = min(seg_len, n - off)
            m = padded_length(length, w) // w
            cb = m // 8
            seg = _Segment(
                off=off, length=length, chunk=m, ys=[0.0] * w, z=torch.empty(0), zs=0.0,
                send=_u8(device, w, cb + 4), recv=_u8(device, w, cb + 4),
                send2=_u8(device, w, cb + 4), recv2=_u8(device, w, cb + 4),
            )
            lo, hi = seg.chunk_range(self.rank)
            seg.z = torch.zeros(hi - lo, dtype=torch.float32, device=device)
            segments.append(seg)
        y = torch.zeros(n, dtype=torch.float32, device=device)
        return _Buffers(n=n, y=y, segments=segments)


def _u8(device: torch.device, *shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.uint8, device=device)


def _scale_bytes(s: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([s], dtype=torch.float32).view(torch.uint8).to(device)


def _read_scales(rows: torch.Tensor, cb: int) -> list[float]:
    """The float32 scale appended after the ``cb`` packed bytes of each row."""
    tail = torch.empty((rows.shape[0], 4), dtype=torch.uint8, device=rows.device)
    tail.copy_(rows[:, cb:])
    return tail.view(torch.float32).reshape(-1).cpu().tolist()
