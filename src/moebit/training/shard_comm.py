"""Compressed collectives for sharded training, installed through FSDP2's comm hooks.

FSDP2 lets each ``fully_shard`` unit replace its gradient reduce-scatter
(``set_custom_reduce_scatter``) and its parameter all-gather (``set_custom_all_gather``).
Both see one flat buffer per unit: the reduce-scatter input is ``[W * C]`` (rank r's
output is the sum over ranks of chunk r), the all-gather output is ``[W * C]`` with this
rank's ``C`` elements already copied in at offset ``r * C``.

Formats (``mode``):

* ``none``: the exact collective, counted in ``moebit.comm.stats``: the backend's own
  (``reduce_scatter_single`` / ``all_gather_single``) or an all-to-all, whichever
  measured faster on these ranks (``moebit.training.shard_transport``).
* ``bf16``: the chunks travel in bfloat16. The reduce-scatter sends every chunk to its
  owner (``all_to_all``) and the owner sums in float32, so only one rounding per
  contribution is paid, never one per ring hop.
* ``int8``: block quantization, one float32 scale per ``block`` elements
  (``scale = max|x| / 127``). The reduce-scatter keeps an error-feedback residual per
  unit (what quantization dropped this step is added to next step's gradient: the
  qgZ/1-bit-Adam trick that keeps the running sum of transmitted gradients within one
  step's error of the exact one). The all-gather (ZeRO++ qwZ) dequantizes every chunk,
  this rank's own included, so all ranks compute with the same unsharded weights; the
  sharded master weights the optimizer updates stay exact.

Bytes are recorded under ``fsdp.rs.<mode>`` and ``fsdp.ag.<mode>`` (kinds ``rs`` and
``ag`` of ``moebit.comm.stats.kind_of``) as the algorithmic volume each rank sends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from moebit.comm import stats
from moebit.training.shard_config import DEFAULT_BLOCK, MODES
from moebit.training.shard_transport import TRANSPORT_AG, TRANSPORT_RS, Transport


def _check_mode(mode: str, what: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{what} must be one of {MODES}, got {mode!r}")
    return mode


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales of ``x`` [..., n], in blocks of ``block`` along n.

    Returns (codes [..., n_pad] int8, scales [..., n_pad / block] float32) where n_pad is
    n rounded up to a multiple of ``block`` (the padding encodes zeros). Every element's
    error is at most half its block's scale, i.e. ``max|x_block| / 254``.
    """
    n = x.shape[-1]
    n_pad = max(block, math.ceil(n / block) * block)
    xf = x.float()
    if n_pad != n:
        xf = torch.nn.functional.pad(xf, (0, n_pad - n))
    xb = xf.reshape(*xf.shape[:-1], n_pad // block, block)
    scale = xb.abs().amax(dim=-1).clamp_min(1e-30) / 127.0
    codes = torch.round(xb / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(*x.shape[:-1], n_pad), scale


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [..., n] from ``quantize_blocks``' codes and scales."""
    nb = scale.shape[-1]
    x = codes.float().reshape(*codes.shape[:-1], nb, -1) * scale.unsqueeze(-1)
    return x.reshape(*codes.shape[:-1], -1)[..., :n]


def _sum_reduction(op: object, world: int) -> float:
    """The factor to multiply a sum by for ``op``: FSDP is set to force SUM (then 1.0);
    AVG is accepted too. Anything else (PREMUL_SUM, MAX) is refused by name."""
    if op == dist.ReduceOp.SUM:
        return 1.0
    if op == dist.ReduceOp.AVG:
        return 1.0 / world
    raise ValueError(f"compressed reduce-scatter supports SUM and AVG reductions, got {op}")


class CompressedReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter of a unit's gradients in ``mode`` (one instance per unit:
    the int8 error-feedback residual belongs to that unit's flat buffer)."""

    def __init__(self, mode: str = "none", block: int = DEFAULT_BLOCK,
                 error_feedback: bool = True, transport: str = "auto") -> None:
        self.mode = _check_mode(mode, "rs_compress")
        self.block = block
        self.error_feedback = error_feedback and mode == "int8"
        self.residual: torch.Tensor | None = None
        self.transport = Transport("rs", TRANSPORT_RS, transport)


    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: object, async_op: bool = False) -> None:
        world = dist.get_world_size(group)
        factor = _sum_reduction(op, world)
        how = self.transport(output_tensor, input_tensor, group) if self.mode == "none" else ""
        t0 = time.perf_counter()
        if self.mode == "none":
            TRANSPORT_RS[how](output_tensor, input_tensor, group)
            sent = (world - 1) * output_tensor.numel() * output_tensor.element_size()
        else:
            sent = self._exchange(output_tensor, input_tensor, group, world)
        if factor != 1.0:
            output_tensor.mul_(factor)
        stats.record(f"fsdp.rs.{self.mode}", sent, sent, time.perf_counter() - t0)
        return None

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                  world: int) -> int:
        """Send chunk r to rank r in the wire format, sum what arrives in float32."""
        chunk = out.numel()
        x_WC = inp.view(world, chunk).float()
        if self.error_feedback:
            if self.residual is None or self.residual.shape != x_WC.shape:
                self.residual = torch.zeros_like(x_WC)
            x_WC = x_WC + self.residual
        if self.mode == "bf16":
            wire = x_WC.to(torch.bfloat16)
            got = torch.empty_like(wire)
            dist.all_to_all_single(got, wire, group=group)
            out.copy_(got.float().sum(0))
            return (world - 1) * chunk * 2
        codes, scale = quantize_blocks(x_WC, self.block)
        if self.error_feedback:
            self.residual = x_WC - dequantize_blocks(codes, scale, chunk)
        got_codes, got_scale = torch.empty_like(codes), torch.empty_like(scale)
        dist.all_to_all_single(got_codes, codes, group=group)
        dist.all_to_all_single(got_scale, scale, group=group)
        out.copy_(dequantize_blocks(got_codes, got_scale, chunk).sum(0))
        return (world - 1) * (codes.shape[1] + scale.shape[1] * 4)


class CompressedAllGather(AllGather):
    """FSDP2 parameter all-gather in ``mode``; buffers that are not floating point (FSDP
    packs mixed dtypes as uint8) always travel exactly."""

    def __init__(self, mode: str = "none", block: int = DEFAULT_BLOCK,
                 transport: str = "auto") -> None:
        self.mode = _check_mode(mode, "ag_compress")
        self.block = block
        self.transport = Transport("ag", TRANSPORT_AG, transport)


    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        world = dist.get_world_size(group)
        n = input_tensor.numel()
        mode = self.mode if input_tensor.is_floating_point() else "none"
        how = self.transport(output_tensor, input_tensor, group) if mode == "none" else ""
        t0 = time.perf_counter()
        if mode == "none":
            TRANSPORT_AG[how](output_tensor, input_tensor, group)
            sent = (world - 1) * n * input_tensor.element_size()
        elif mode == "bf16":
            wire = input_tensor.to(torch.bfloat16)
            got = torch.empty(world * n, dtype=torch.bfloat16, device=wire.device)
            dist.all_gather_single(got, wire, group=group)
            output_tensor.copy_(got)
            sent = (world - 1) * n * 2
        else:
            codes, scale = quantize_blocks(input_tensor, self.block)
            got_codes = codes.new_empty(world * codes.numel())
            got_scale = scale.new_empty(world * scale.numel())
            dist.all_gather_single(got_codes, codes, group=group)
            dist.all_gather_single(got_scale, scale, group=group)
            deq = dequantize_blocks(got_codes.view(world, -1), got_scale.view(world, -1), n)
            output_tensor.view(world, n).copy_(deq)
            sent = (world - 1) * (codes.numel() + scale.numel() * 4)
        stats.record(f"fsdp.ag.{mode}", sent, sent, time.perf_counter() - t0)
        return None


def replicate_allreduce_counter(group_size: int):  # noqa: ANN201 - a closure for FSDP
    """An FSDP ``all_reduce_hook`` for HSDP that records the replicate-dim allreduce FSDP
    has just run (FSDP issues it itself; the hook only counts its bytes)."""

    def hook(reduced: torch.Tensor) -> None:
        nbytes = reduced.numel() * reduced.element_size()
        sent = stats.ring_allreduce_bytes(nbytes, group_size)
        stats.record("fsdp.allreduce.replicate", sent, sent)

    return hook
