"""Expert parallelism: all-to-all with variable splits, process groups, parameter groups.

ep_size ranks share the E experts, E/ep_size each. Every rank routes its own tokens over
all E experts, sends each token to the rank that owns its expert, runs its local experts
on what it received, and sends the outputs back. Only real tokens travel: the per-expert
counts are exchanged first (a tiny all_to_all) and both token exchanges use
``all_to_all_single`` with those uneven split sizes, where DeepSpeed sends a padded
[E, capacity, d] buffer. Gloo supports uneven and zero-sized splits (tested).

The token exchanges themselves (wire formats, the hierarchical two-stage exchange) live in
``moebit.comm.all_to_all``; ``MoEConfig.a2a_dtype`` / ``a2a_grad_dtype`` pick the formats.

Groups: expert-parallel groups are blocks of ep_size consecutive
ranks; expert-data-parallel groups stride across them and hold the replicas of the same
experts. Expert gradients are averaged over the expert-dp group, all others over the world.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moebit.comm import collectives
from moebit.comm.all_to_all import (
    OP_FLAT,
    Hierarchy,
    all_to_all_rows,
    dispatch_route,
    hierarchy_groups,
    make_route,
)

OP_NAME = OP_FLAT


@dataclass(frozen=True)
class EPGroups:
    """This rank's expert-parallel group and expert-data-parallel group.

    A group is None where it is the whole world (or there is no process group at all).
    """

    ep_size: int
    ep_group: dist.ProcessGroup | None
    expert_dp_group: dist.ProcessGroup | None
    ep_ranks: tuple[int, ...]
    expert_dp_ranks: tuple[int, ...]
    hierarchy: Hierarchy | None = None  # two-stage token exchange when ep spans nodes


def local_world_size(override: int | None = None) -> int:
    """Ranks per node: torchrun's LOCAL_WORLD_SIZE (the whole world when unset)."""
    if override is not None:
        return override
    return int(os.environ.get("LOCAL_WORLD_SIZE", collectives.world_size()))


def expert_parallel_groups(ep_size: int, hierarchical: bool = False,
                           local_size: int | None = None) -> EPGroups:
    """Create the ep and expert-dp groups; every rank must call this, in the same order.

    world 8, ep 2: ep groups [0,1] [2,3] [4,5] [6,7]; expert-dp groups [0,2,4,6] [1,3,5,7].
    ``dist.new_group`` is collective over the world, so all groups are created on every
    rank (ep groups first, then expert-dp groups) and each rank keeps its own two.
    ``hierarchical`` also creates the intra- and inter-node groups of ep groups that span
    nodes of ``local_size`` ranks (default LOCAL_WORLD_SIZE; torchrun numbers the ranks of
    a node consecutively); an ep group inside one node stays flat.
    """
    world, me = collectives.world_size(), collectives.rank()
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    if world % ep_size:
        raise ValueError(f"ep_size = {ep_size} does not divide the world size {world}")
    ep_blocks = [tuple(range(s, s + ep_size)) for s in range(0, world, ep_size)]
    dp_blocks = [tuple(range(j, world, ep_size)) for j in range(ep_size)]
    mine_ep = next(b for b in ep_blocks if me in b)
    mine_dp = next(b for b in dp_blocks if me in b)
    if world == 1:
        return EPGroups(ep_size, None, None, mine_ep, mine_dp)

    def make(blocks: list[tuple[int, ...]], mine: tuple[int, ...]) -> dist.ProcessGroup | None:
        if len(mine) == world:
            return None  # the default group: no new communicator needed
        found = None
        for b in blocks:
            g = dist.new_group(list(b))
            if b == mine:
                found = g
        return found

    ep_group, dp_group = make(ep_blocks, mine_ep), make(dp_blocks, mine_dp)
    hierarchy = None
    if hierarchical:  # after the other groups: the creation order must match on every rank
        hierarchy = hierarchy_groups(ep_blocks, local_world_size(local_size), me)
    return EPGroups(ep_size, ep_group, dp_group, mine_ep, mine_dp, hierarchy)


def all_to_all(
    x_ND: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None,
    fmt: str = "auto", grad_fmt: str = "auto", hierarchy: Hierarchy | None = None,
) -> torch.Tensor:
    """Differentiable all_to_all of rows with uneven splits (``len(send) == group size``),
    the rows in wire format ``fmt`` and their gradients in ``grad_fmt``."""
    if sum(send) != x_ND.shape[0]:
        raise ValueError(f"send splits sum to {sum(send)} but x has {x_ND.shape[0]} rows")
    return all_to_all_rows(x_ND, make_route(send, recv, group, hierarchy), fmt, grad_fmt)


def expert_parallel_apply(
    x_ND: torch.Tensor,
    counts_E: torch.Tensor,
    experts: nn.Module,
    group: dist.ProcessGroup | None,
    fmt: str = "auto",
    grad_fmt: str = "auto",
    hierarchy: Hierarchy | None = None,
) -> torch.Tensor:
    """Run ``experts`` (this rank's E_local) on rows sorted by global expert, across ranks.

    ``x_ND`` holds this rank's routed rows in global expert order with ``counts_E`` [E]
    rows per expert; the result has the same rows in the same order. Dispatch and combine
    send the rows in ``fmt`` and their gradients in ``grad_fmt``.
    """
    route, recv_RE = dispatch_route(counts_E, group, hierarchy)  # [source rank, local expert]
    x_recv = all_to_all_rows(x_ND, route, fmt, grad_fmt)
    # Arrived rank-major ([r][e]); the experts need expert-major blocks ([e][r]).
    ranks, local = recv_RE.shape
    block_key = (torch.arange(local).unsqueeze(0) * ranks + torch.arange(ranks).unsqueeze(1))
    row_key = torch.repeat_interleave(block_key.reshape(-1), recv_RE.reshape(-1).cpu())
    to_expert_major = torch.argsort(row_key, stable=True).to(x_ND.device)
    y_local = experts(x_recv.index_select(0, to_expert_major), recv_RE.sum(0).tolist())
    back_to_rank_major = torch.argsort(to_expert_major)
    y_recv = y_local.index_select(0, back_to_rank_major)
    return all_to_all_rows(y_recv, route.reversed(), fmt, grad_fmt)


def is_expert_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, "moebit_expert", False))


def split_params_for_ep(
    model: nn.Module, expert_dp_group: dist.ProcessGroup | None | str = "auto"
) -> list[dict[str, Any]]:
    """Optimizer param groups: dense params averaged over the world, experts over expert-dp.

    Returns ``[{"params": dense, "process_group": None, "moebit_group": "dense"},
    {"params": experts, "process_group": expert_dp_group, "moebit_group": "expert"}]``
    (empty groups left out). ``"auto"`` takes the expert-dp group from the model's MoE
    layers (their ``ep_groups``); all layers must agree.
    """
    if expert_dp_group == "auto":
        found = {id(g.expert_dp_group): g.expert_dp_group for g in _ep_groups_of(model)}
        if len(found) > 1:
            raise ValueError("the model's MoE layers use different expert-data-parallel groups")
        expert_dp_group = next(iter(found.values())) if found else None
    dense = [p for p in model.parameters() if not is_expert_param(p)]
    expert = [p for p in model.parameters() if is_expert_param(p)]
    groups: list[dict[str, Any]] = []
    if dense:
        groups.append({"params": dense, "process_group": None, "moebit_group": "dense"})
    if expert:
        groups.append(
            {"params": expert, "process_group": expert_dp_group, "moebit_group": "expert"}
        )
    return groups


def _ep_groups_of(model: nn.Module) -> Iterable[EPGroups]:
    for m in model.modules():
        g = getattr(m, "ep_groups", None)
        if isinstance(g, EPGroups):
            yield g


def allreduce_grads_(param_groups: list[dict[str, Any]]) -> None:
    """Average gradients in place, each param group over its ``process_group``.

    A missing gradient (an expert that got no token on this rank) counts as zeros, so
    every rank contributes the same buffers and the collectives stay matched.
    """
    for group in param_groups:
        grads = []
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        op = f"allreduce.{group.get('moebit_group', 'params')}"
        collectives.allreduce_mean_(grads, group.get("process_group"), op_name=op)
