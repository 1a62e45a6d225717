"""All-to-all of rows with uneven splits: plain, compressed, and hierarchical, differentiable.

Expert parallelism sends every routed token to the rank that owns its expert and the
expert's output back (dispatch and combine). Once 1-bit Adam has shrunk the
gradient traffic, these two exchanges are most of what is left on a slow link, and they
travel in the compute dtype. Here each row can go on the wire in a narrower format:

- ``fp32`` / ``bf16`` / ``fp16``: a cast (relative error 2^-24 / 2^-9 / 2^-12 per
  element, fp16 only within +-65504);
- ``int8``: symmetric per-row (per-token) scale, absmax / 127, sent as 4 bytes after the
  row's d bytes; error at most absmax / 254 per element;
- ``fp8_e4m3``: per-row scale absmax / 448 and torch's float8_e4m3fn; relative error 2^-4
  for normal values, where torch has that dtype on the device.

Error feedback does not apply (an activation is used once), so the cost is a quality
question, measured in docs/benchmarks.md. ``auto`` sends the tensor as it is.

Every format goes through one ``all_to_all_single`` per exchange (payload and scales in
one row of bytes). The hierarchical exchange (DeepSpeed-MoE's inference paper) first
regroups rows inside a node, so that each rank then sends one larger message per remote
node instead of one per remote rank: (nodes - 1) inter-node messages instead of
(nodes - 1) * ranks-per-node, the same rows arriving in the same order as the flat one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moebit.comm import _rowquant_c, collectives, stats

A2A_DTYPES = ("auto", "fp32", "bf16", "fp16", "int8", "fp8_e4m3")
OP_FLAT = "moe.all_to_all"
OP_INTRA = "moe.all_to_all.intra"
OP_INTER = "moe.all_to_all.inter"

_CASTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_INT8_MAX = 127.0
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_wire_dtype(name: str, key: str = "a2a_dtype", device: torch.device | None = None) -> None:
    """Raise ValueError naming ``key`` when ``name`` is unknown, or unsupported on ``device``
    (checked only when a device is given: a config is validated before it has one)."""
    if name not in A2A_DTYPES:
        raise ValueError(f"{key} must be one of {', '.join(A2A_DTYPES)}, got {name!r}")
    if name == "fp8_e4m3" and device is not None:
        dev = device
        why = _fp8_unsupported(dev.type)
        if why:
            raise ValueError(
                f"{key} = 'fp8_e4m3' is not supported by torch {torch.__version__} on "
                f"device {dev.type}: {why}; use int8 (same bytes) or bf16"
            )


def _fp8_unsupported(device_type: str) -> str:
    """Why float8_e4m3fn cannot round-trip on this device type ('' when it can).

    Asked once per device type and remembered: the probe allocates on the device.
    """
    if device_type in _fp8_probe:
        return _fp8_probe[device_type]
    fp8 = getattr(torch, "float8_e4m3fn", None)
    why = ""
    if fp8 is None:
        why = "this torch has no float8_e4m3fn"
    else:
        try:
            torch.ones(2, device=device_type).to(fp8).view(torch.uint8).view(fp8).float()
        except (TypeError, RuntimeError) as e:
            why = str(e).splitlines()[0]
    _fp8_probe[device_type] = why
    return why


_fp8_probe: dict[str, str] = {}


def encode(x_ND: torch.Tensor, fmt: str) -> torch.Tensor:
    """The rows as sent: the same rows, possibly narrower, possibly as bytes with scales.

    int8 and fp8 rows are one uint8 buffer, [N, d + 4]: the d values, then the row's
    float32 scale, so that payload and scales travel in one message with the rows' splits.
    """
    if fmt == "auto" or (fmt in _CASTS and _CASTS[fmt] == x_ND.dtype):
        return x_ND.contiguous()
    if fmt in _CASTS:
        return x_ND.to(_CASTS[fmt]).contiguous()
    # d named, not inferred: a rank may send no row at all, and -1 is ambiguous for 0 elements
    x = x_ND.reshape(x_ND.shape[0], math.prod(x_ND.shape[1:]))
    if fmt == "int8":
        native = _rowquant_c.encode_int8(x)
        if native is not None:
            return native
    return _encode_scaled(x, fmt)


def _encode_scaled(x_ND: torch.Tensor, fmt: str) -> torch.Tensor:
    """The torch path of the scaled formats (the native int8 kernel gives identical bytes).

    Written straight into the one output buffer: no ``cat``, no clamp (|x| / scale never
    exceeds the format's top), and a row with NaN or inf gets a non-finite scale and zero
    values, so that it decodes to NaN instead of hiding the fault.
    """
    n, d = x_ND.shape
    xf = x_ND.float()
    top = _INT8_MAX if fmt == "int8" else _FP8_MAX
    amax = xf.abs().amax(1, keepdim=True) if n else xf.new_zeros(0, 1)
    scale_N1 = torch.where(amax == 0, 1.0, amax / top)
    scaled = xf * scale_N1.reciprocal()
    out = torch.empty(n, d + 4, dtype=torch.uint8, device=x_ND.device)
    if fmt == "int8":  # NaN has no int8 value: such a row is all zeros with a NaN scale
        out[:, :d].view(torch.int8).copy_(scaled.nan_to_num_(0.0).round_())
    else:
        out[:, :d].view(torch.float8_e4m3fn).copy_(scaled)
    out[:, d:].copy_(scale_N1.view(torch.uint8))
    return out


def decode(p_NB: torch.Tensor, fmt: str, dtype: torch.dtype, d: int) -> torch.Tensor:
    """Rows of ``dtype`` back from what ``encode`` sent (``d`` values per row)."""
    if fmt == "auto" or fmt in _CASTS:
        return p_NB if p_NB.dtype == dtype else p_NB.to(dtype)
    if fmt == "int8":
        native = _rowquant_c.decode_int8(p_NB, dtype, d)
        if native is not None:
            return native
    q = p_NB[:, :d].view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    scale_N1 = p_NB[:, d:].contiguous().view(torch.float32)
    if fmt != "int8":
        q = q.float()  # float8 times float32 has no kernel; int8 promotes in the multiply
    return torch.mul(q, scale_N1).to(dtype)


@dataclass(frozen=True)
class Hierarchy:
    """Two-stage groups of one expert-parallel group: ranks are ``node * local + l``.

    ``intra`` joins this rank's node (group rank = l), ``inter`` the ranks with this rank's
    local index on every node (group rank = node).
    """

    nodes: int
    local: int
    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


@dataclass(frozen=True)
class Route:
    """One exchange: ``send[r]`` rows to ep rank r, ``recv[r]`` from it, in a wire format.

    ``matrix`` (hierarchical only) holds every rank's send splits, [source][destination].
    """

    send: list[int]
    recv: list[int]
    group: dist.ProcessGroup | None
    hierarchy: Hierarchy | None = None
    matrix: torch.Tensor | None = None

    def reversed(self) -> Route:
        m = None if self.matrix is None else self.matrix.t().contiguous()
        return Route(self.recv, self.send, self.group, self.hierarchy, m)


def make_route(send: list[int], recv: list[int], group: dist.ProcessGroup | None,
               hierarchy: Hierarchy | None = None,
               matrix: torch.Tensor | None = None) -> Route:
    """Check the splits. A hierarchical route needs every rank's send splits
    (``matrix``, [source][destination]): pass it when already known (``dispatch_route``
    has it), otherwise it is gathered here (one tiny collective)."""
    n = collectives.world_size(group)
    if len(send) != n or len(recv) != n:
        raise ValueError(f"split sizes {send} / {recv} do not match the group size {n}")
    if hierarchy is None or n == 1:
        return Route(list(send), list(recv), group)
    if hierarchy.nodes * hierarchy.local != n:
        raise ValueError(f"hierarchy {hierarchy.nodes} nodes x {hierarchy.local} does not "
                         f"match the expert-parallel group of {n} ranks")
    if matrix is None:
        every = torch.empty(n * n, dtype=torch.int64)
        _gather_counts(every, torch.tensor(send, dtype=torch.int64), group)
        matrix = every.view(n, n)
    me = collectives.rank(group)
    if tuple(matrix.shape) != (n, n) or matrix[me].tolist() != list(send) \
            or matrix[:, me].tolist() != list(recv):
        raise ValueError(f"split matrix {matrix.tolist()} does not hold this rank's ({me}) "
                         f"send splits {send} and receive splits {recv}")
    return Route(list(send), list(recv), group, hierarchy, matrix)


def _gather_counts(out: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    t0 = time.perf_counter()
    collectives.all_gather_flat(out, mine, group=group)
    n = collectives.world_size(group)
    moved = mine.numel() * mine.element_size() * (n - 1)
    stats.record(OP_FLAT, moved, moved, time.perf_counter() - t0)


def dispatch_route(counts_E: torch.Tensor, group: dist.ProcessGroup | None,
                   hierarchy: Hierarchy | None = None) -> tuple[Route, torch.Tensor]:
    """The route of rows sorted by destination slot, and what arrives: [source rank, slot].

    ``counts_E`` holds this rank's rows per slot (an expert), ``E = ranks * slots_per_rank``,
    rank r owning slots ``[r * E_local, (r + 1) * E_local)``. Exactly one tiny collective
    learns the receive counts: an all_to_all of the counts for a flat route; for a
    hierarchical one an all-gather of every rank's counts, which also gives the split
    matrix the two stages need (no second exchange of split sizes).
    """
    n = collectives.world_size(group)
    if counts_E.numel() % n:
        raise ValueError(f"counts_E has {counts_E.numel()} slots, not a multiple of the "
                         f"group size {n}")
    counts = counts_E.detach().to(torch.int64).view(n, -1)  # on its device (NCCL needs it)
    send = counts.sum(1).tolist()
    if n == 1:
        return Route(send, send, group), counts.cpu()
    if hierarchy is None:
        got = torch.empty_like(counts)
        t0 = time.perf_counter()
        dist.all_to_all_single(got, counts, group=group)
        moved = counts[0].numel() * 8 * (n - 1)
        stats.record(OP_FLAT, moved, moved, time.perf_counter() - t0)
        got = got.cpu()
        return make_route(send, got.sum(1).tolist(), group), got
    every = counts.new_empty(n * counts.numel())
    _gather_counts(every, counts.reshape(-1), group)
    every_RDE = every.cpu().view(n, n, -1)  # [source, destination, slot]
    got = every_RDE[:, collectives.rank(group)].contiguous()
    matrix = every_RDE.sum(2)
    return make_route(send, got.sum(1).tolist(), group, hierarchy, matrix), got


def _exchange(p: torch.Tensor, send: list[int], recv: list[int],
              group: dist.ProcessGroup | None, op: str) -> torch.Tensor:
    out = p.new_empty((sum(recv), *p.shape[1:]))
    t0 = time.perf_counter()
    if collectives.world_size(group) == 1:
        out.copy_(p)
    else:
        dist.all_to_all_single(out, p, output_split_sizes=recv, input_split_sizes=send,
                               group=group)
    me = collectives.rank(group)
    row = math.prod(p.shape[1:]) * p.element_size()
    stats.record(op, (sum(send) - send[me]) * row, (sum(recv) - recv[me]) * row,
                 time.perf_counter() - t0)
    return out


def _transpose_blocks(sizes_PQ: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Row order that turns blocks laid out [p][q] (sizes_PQ rows each) into [q][p]."""
    p, q = sizes_PQ.shape
    key = (torch.arange(q).unsqueeze(0) * p + torch.arange(p).unsqueeze(1)).reshape(-1)
    row_key = torch.repeat_interleave(key, sizes_PQ.reshape(-1))
    return torch.argsort(row_key, stable=True).to(device)


def _hierarchical(p: torch.Tensor, route: Route) -> torch.Tensor:
    """Stage 1 inside the node (rows for (node b, local m) go to local peer m), stage 2
    across nodes (one message per node); the result is in source-rank order, as flat."""
    h, m_all = route.hierarchy, route.matrix
    assert h is not None and m_all is not None
    me = collectives.rank(route.group)
    node, loc = divmod(me, h.local)
    mine_BL = m_all[me].view(h.nodes, h.local)  # my rows per destination (b, m)
    x1 = p.index_select(0, _transpose_blocks(mine_BL, p.device))  # now [m][b]
    # what every peer l of my node sends me in stage 1: blocks [l][b] for destinations (b, loc)
    peers = m_all[node * h.local:(node + 1) * h.local].view(h.local, h.nodes, h.local)
    got_LB = peers[:, :, loc]
    r1 = _exchange(x1, mine_BL.sum(0).tolist(), got_LB.sum(1).tolist(), h.intra, OP_INTRA)
    x2 = r1.index_select(0, _transpose_blocks(got_LB, p.device))  # now [b][l]
    recv2 = m_all[:, me].view(h.nodes, h.local).sum(1).tolist()
    return _exchange(x2, got_LB.sum(0).tolist(), recv2, h.inter, OP_INTER)


def exchange_rows(x_ND: torch.Tensor, route: Route, fmt: str = "auto") -> torch.Tensor:
    """Send rows along ``route`` in wire format ``fmt``; rows come back in ``x_ND.dtype``."""
    if sum(route.send) != x_ND.shape[0]:
        raise ValueError(f"send splits sum to {sum(route.send)} but x has {x_ND.shape[0]} rows")
    p = encode(x_ND, fmt)
    if route.hierarchy is None or route.matrix is None:
        out = _exchange(p, route.send, route.recv, route.group, OP_FLAT)
    else:
        out = _hierarchical(p, route)
    return decode(out, fmt, x_ND.dtype, math.prod(x_ND.shape[1:]))


class _RowsAllToAll(torch.autograd.Function):
    """Forward along ``route`` in ``fmt``; backward along the reverse route in ``grad_fmt``."""

    @staticmethod
    def forward(ctx, x, route, fmt, grad_fmt):  # type: ignore[override]
        ctx.route, ctx.grad_fmt = route, grad_fmt
        return exchange_rows(x, route, fmt)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return exchange_rows(g.contiguous(), ctx.route.reversed(), ctx.grad_fmt), None, None, None


def all_to_all_rows(x_ND: torch.Tensor, route: Route, fmt: str = "auto",
                    grad_fmt: str = "auto") -> torch.Tensor:
    """Differentiable all-to-all of rows: the activations in ``fmt``, their gradients in
    ``grad_fmt`` (both one of ``A2A_DTYPES``)."""
    check_wire_dtype(fmt, "a2a_dtype", x_ND.device)
    check_wire_dtype(grad_fmt, "a2a_grad_dtype", x_ND.device)
    return _RowsAllToAll.apply(x_ND, route, fmt, grad_fmt)


def hierarchy_groups(ep_blocks: list[tuple[int, ...]], local: int, me: int) -> Hierarchy | None:
    """Create the intra- and inter-node groups of every ep group (collective over the world:
    every rank calls this with the same blocks); return this rank's, or None when its ep
    group fits in one node. Ranks ``[k * local, (k + 1) * local)`` share node k."""
    mine: Hierarchy | None = None
    for block in ep_blocks:
        n = len(block)
        if n <= local:
            continue
        if n % local or block[0] % local:
            raise ValueError(f"expert-parallel group {block} does not cover whole nodes of "
                             f"{local} ranks (LOCAL_WORLD_SIZE): a2a_hierarchical needs that")
        nodes = n // local
        intra = [dist.new_group(list(block[k * local:(k + 1) * local])) for k in range(nodes)]
        inter = [dist.new_group(list(block[m::local])) for m in range(local)]
        if me in block:
            i = block.index(me)
            mine = Hierarchy(nodes, local, intra[i // local], inter[i % local])
    return mine
