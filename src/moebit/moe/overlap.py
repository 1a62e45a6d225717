"""Expert parallelism with the token exchange split into chunks that overlap expert compute.

``expert_parallel_apply`` sends all of a layer's tokens, waits, computes, then sends all
results back: the link idles while the experts run and the experts idle while the link
runs. Here every expert's block is split into ``chunks`` parts. All chunks' dispatches
start at once (``async_op=True``); the experts run on chunk c as soon as it has arrived,
while chunks c+1... are still in flight, and chunk c's combine starts right after. The
backward pass does the same with the gradients (the combine's gradients go out first,
the experts' backward runs per chunk, the input gradients go back asynchronously).

The experts of each chunk form their own small autograd graph, run by a nested
``torch.autograd.backward`` inside this node's backward (as activation checkpointing
does): the expert weights get their gradients as usual through ``loss.backward()``,
but ``torch.autograd.grad(loss, expert_params)`` would not see them.

Counted time is only what a rank spends blocked in ``wait()``: what the overlap hides is
not counted as communication.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moebit.comm import collectives, stats
from moebit.comm.all_to_all import OP_FLAT, check_wire_dtype, decode, encode

Pending = tuple[Any, torch.Tensor, float]


def chunk_counts(counts_E: torch.Tensor, chunks: int) -> torch.Tensor:
    """[chunks, E]: each expert's rows split as evenly as possible, earlier chunks larger."""
    base = torch.div(counts_E, chunks, rounding_mode="floor")
    extra = counts_E - base * chunks
    return base.unsqueeze(0) + (torch.arange(chunks).unsqueeze(1) < extra.unsqueeze(0)).long()


def chunk_rows(counts_E: torch.Tensor, counts_CE: torch.Tensor) -> list[torch.Tensor]:
    """For each chunk, the indices of its rows in the expert-sorted input (still sorted)."""
    starts = torch.cumsum(counts_E, 0) - counts_E
    offs = torch.cumsum(counts_CE, 0) - counts_CE  # where chunk c starts inside each block
    out = []
    for c in range(counts_CE.shape[0]):
        n = counts_CE[c]
        first = torch.repeat_interleave(starts + offs[c] - (torch.cumsum(n, 0) - n), n)
        out.append(first + torch.arange(int(n.sum())))
    return out


def _start(p: torch.Tensor, send: list[int], recv: list[int],
           group: dist.ProcessGroup | None) -> Pending:
    out = p.new_empty((sum(recv), *p.shape[1:]))
    t0 = time.perf_counter()
    work = dist.all_to_all_single(out, p, output_split_sizes=recv, input_split_sizes=send,
                                  group=group, async_op=True)
    me = collectives.rank(group)
    row = math.prod(p.shape[1:]) * p.element_size()
    stats.record(OP_FLAT, (sum(send) - send[me]) * row, (sum(recv) - recv[me]) * row, 0.0)
    return work, out, time.perf_counter() - t0


def _finish(pending: Pending) -> torch.Tensor:
    work, out, spent = pending
    t0 = time.perf_counter()
    work.wait()
    stats.add_time(OP_FLAT, spent + time.perf_counter() - t0)
    return out


def _expert_major(recv_RE: torch.Tensor, device: torch.device) -> torch.Tensor:
    ranks, local = recv_RE.shape
    key = torch.arange(local).unsqueeze(0) * ranks + torch.arange(ranks).unsqueeze(1)
    row_key = torch.repeat_interleave(key.reshape(-1), recv_RE.reshape(-1))
    return torch.argsort(row_key, stable=True).to(device)


class _Overlapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, plan, experts, fmt, grad_fmt):  # type: ignore[override]
        group, rows, send, recv, recv_CRE, need_grad = plan
        d = x_ND.shape[1]
        pend = [_start(encode(x_ND.index_select(0, r), fmt), s, q, group)
                for r, s, q in zip(rows, send, recv, strict=True)]
        outs, saved = [], []
        for c, p in enumerate(pend):
            x_c = decode(_finish(p), fmt, x_ND.dtype, d)
            order = _expert_major(recv_CRE[c], x_ND.device)
            with torch.set_grad_enabled(need_grad):
                leaf = x_c.index_select(0, order).detach().requires_grad_(x_ND.requires_grad)
                y_loc = experts(leaf, recv_CRE[c].sum(0).tolist())
            saved.append((leaf, y_loc))
            y_c = y_loc.detach().index_select(0, torch.argsort(order))
            outs.append((_start(encode(y_c, fmt), recv[c], send[c], group), y_c.dtype))
        out = None
        for r, (p, dtype) in zip(rows, outs, strict=True):
            y = decode(_finish(p), fmt, dtype, d)
            if out is None:
                out = y.new_empty(x_ND.shape[0], d)
            out.index_copy_(0, r, y)
        ctx.plan, ctx.saved, ctx.grad_fmt, ctx.x_dtype = plan, saved, grad_fmt, x_ND.dtype
        return out if out is not None else x_ND.new_empty(0, d)

    @staticmethod
    def backward(ctx, g_ND):  # type: ignore[override]
        group, rows, send, recv, recv_CRE, _ = ctx.plan
        fmt, d = ctx.grad_fmt, g_ND.shape[1]
        pend = [_start(encode(g_ND.index_select(0, r).contiguous(), fmt), s, q, group)
                for r, s, q in zip(rows, send, recv, strict=True)]
        backs = []
        for c, p in enumerate(pend):
            leaf, y_loc = ctx.saved[c]
            order = _expert_major(recv_CRE[c], g_ND.device)
            g_c = decode(_finish(p), fmt, y_loc.dtype, d).index_select(0, order)
            torch.autograd.backward(y_loc, g_c)  # expert weight gradients accumulate here
            gx = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            gx = gx.index_select(0, torch.argsort(order))
            backs.append(_start(encode(gx, fmt), recv[c], send[c], group))
        gx_ND = g_ND.new_zeros(sum(len(r) for r in rows), d).to(ctx.x_dtype)
        for r, p in zip(rows, backs, strict=True):
            gx_ND.index_copy_(0, r, decode(_finish(p), fmt, ctx.x_dtype, d))
        ctx.saved = None
        return gx_ND, None, None, None, None


def overlapped_apply(x_ND: torch.Tensor, counts_E: torch.Tensor, experts: nn.Module,
                     group: dist.ProcessGroup | None, chunks: int, fmt: str = "auto",
                     grad_fmt: str = "auto") -> torch.Tensor:
    """``expert_parallel_apply`` with the exchanges split into ``chunks`` that overlap the
    experts' compute; same rows, same result (up to the order of floating-point sums)."""
    check_wire_dtype(fmt, "a2a_dtype", x_ND.device)
    check_wire_dtype(grad_fmt, "a2a_grad_dtype", x_ND.device)
    ep = collectives.world_size(group)
    counts_CE = chunk_counts(counts_E.cpu(), chunks)
    # what every rank sends to each of my experts, per chunk: [source rank, chunk, E_local]
    mine = counts_CE.view(chunks, ep, -1).transpose(0, 1).contiguous()
    got = torch.empty_like(mine)
    t0 = time.perf_counter()
    dist.all_to_all_single(got.view(-1), mine.view(-1), group=group)
    moved = 8 * mine[0].numel() * (ep - 1)
    stats.record(OP_FLAT, moved, moved, time.perf_counter() - t0)
    recv_CRE = got.transpose(0, 1).contiguous()
    send = [counts_CE[c].view(ep, -1).sum(1).tolist() for c in range(chunks)]
    recv = [recv_CRE[c].sum(1).tolist() for c in range(chunks)]
    rows = [r.to(x_ND.device) for r in chunk_rows(counts_E.cpu(), counts_CE)]
    plan = (group, rows, send, recv, recv_CRE, torch.is_grad_enabled())
    return _Overlapped.apply(x_ND, plan, experts, fmt, grad_fmt)
