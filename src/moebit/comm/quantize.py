"""int8 with one scale per block of elements, and an average over a process group in int8.

INTELLECT-1 all-reduces DiLoCo's pseudo-gradients in int8. A sum of int8 values overflows
and a ring allreduce re-quantizes at every hop, so this module uses the two-phase scheme of
the 1-bit allreduce (``moebit.comm.compressed``) instead:

1. every rank quantizes its tensor, cut into W chunks (one per rank), and sends chunk r to
   rank r (one ``all_to_all_single``: int8 values with their float32 block scales);
2. rank r dequantizes the W copies of its chunk, averages them in float32, re-quantizes the
   average and sends it to every rank (an all_gather's traffic, sent as an all_to_all).

Every rank then decodes the same bytes, so all ranks hold bitwise the same average. Each
value is rounded twice (once per phase), each time by at most half a step of its block:
|error| <= absmax_block / 254 per phase. Bytes per rank: 2*(W-1)/W * n * (1 + 4/block),
against 2*(W-1)/W * 4n for a ring fp32 allreduce (3.9x less with blocks of 256).

There is no error feedback: a round-to-nearest error is unbiased enough for the outer
step (as in INTELLECT-1); the 1-bit exchange, whose error is not, has it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from moebit.comm import stats

__all__ = ["DEFAULT_BLOCK", "Int8Allreduce", "dequantize_blocks", "quantize_blocks"]

DEFAULT_BLOCK = 256


def quantize_blocks(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and one float32 scale per ``block`` elements of the 1-D float ``x``.

    ``len(x)`` must be a multiple of ``block``. scale = absmax/127 (1 for an all-zero block,
    so decoding never divides by zero); q = round(x/scale), in [-127, 127].
    """
    if x.dim() != 1 or x.numel() % block:
        raise ValueError(f"quantize_blocks needs a 1-D tensor whose length is a multiple of "
                         f"block={block}, got shape {tuple(x.shape)}")
    xb = x.float().view(-1, block)
    scale = xb.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xb / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.view(-1), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """float32 values of ``quantize_blocks``' output."""
    return (q.view(-1, block).float() * scale.unsqueeze(1)).view(-1)


class Int8Allreduce:
    """Averages 1-D float tensors over ``group`` in int8 with per-block scales (see above).

    ``op_prefix`` names the traffic in ``moebit.comm.stats`` (``<prefix>.phase1``,
    ``<prefix>.phase2``). World size 1 still quantizes twice, so a single-process run sees
    the same rounding as a multi-rank one.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, block: int = DEFAULT_BLOCK,
                 op_prefix: str = "int8") -> None:
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"int8 block must be a positive int, got {block!r}")
        initialized = dist.is_available() and dist.is_initialized()
        self.group = group
        self.world = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.block = block
        self.op_prefix = op_prefix

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 average of the 1-D tensor ``x`` over the group (every rank the same)."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 1:
            raise TypeError("int8 allreduce needs a 1-D floating-point tensor")
        w, n = self.world, x.numel()
        chunk = max(1, -(-n // (w * self.block))) * self.block  # elements per rank, padded
        padded = torch.zeros(w * chunk, dtype=torch.float32, device=x.device)
        padded[:n].copy_(x)
        q, s = quantize_blocks(padded, self.block)
        q_recv, s_recv = self._exchange(q, s, "phase1")
        mine = dequantize_blocks(q_recv, s_recv, self.block).view(w, chunk)
        avg = mine[0].clone() if w == 1 else mine.sum(0).div_(w)
        q2, s2 = quantize_blocks(avg, self.block)
        q_all, s_all = self._exchange(q2.repeat(w), s2.repeat(w), "phase2")
        return dequantize_blocks(q_all, s_all, self.block)[:n]

    def _exchange(self, q: torch.Tensor, s: torch.Tensor, phase: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row r of (q, s), cut into W equal rows, goes to rank r; returns what arrived."""
        if self.world == 1:
            return q, s
        t0 = time.perf_counter()
        q_recv, s_recv = torch.empty_like(q), torch.empty_like(s)
        wq = dist.all_to_all_single(q_recv, q, group=self.group, async_op=True)
        ws = dist.all_to_all_single(s_recv, s, group=self.group, async_op=True)
        wq.wait()
        ws.wait()
        moved = (self.world - 1) * (q.numel() + 4 * s.numel()) // self.world
        stats.record(f"{self.op_prefix}.{phase}", moved, moved, time.perf_counter() - t0)
        return q_recv, s_recv
