"""The two-level topology of low-communication training: inner groups and outer groups.

DiLoCo (``moebit.optim.outer``) trains W *workers* that each take H inner steps alone and
then average their pseudo-gradients. On a cluster the cheap links are inside a node and the
slow ones between nodes, so a worker is usually one node:

- the **inner group** is the ranks of one node: they train one replica data-parallel and
  average their gradients every step (over NVLink / shared memory);
- the **outer group** is the ranks with the same local rank on every node: rank j of node n
  holds exactly what rank j of every other node holds, so the outer step averages over it
  (one collective per outer group, all of them running in parallel across the nodes).

The ranks of a node hold one dense replica, so they need not all send it: with the
**share group** (the node's ranks again, as a communicator of its own) each exchanges
1/L of the dense pseudo-gradient over its outer group and the node all-gathers the
averages over its fast link. The slow link then carries each node's model once per
sync, not L times.

``outer_group="world"`` makes every rank its own worker instead: the inner group is the rank
alone and the outer group is every rank (useful on one node, and in tests).

Expert parameters. With expert parallelism inside a node (``ep_size`` dividing the local
world size; moebit numbers ep groups as consecutive ranks), local rank j holds the experts of
ep rank ``j % ep_size`` on every node, so the outer group already holds the same experts on
all its members and syncs them like dense parameters. Their per-step (inner) average is over
the ranks of the node with the same ep rank: ``inner_expert``. Expert parallelism across
nodes would put one worker's experts on several nodes; it is refused with an error.

torchrun numbers the ranks of a node consecutively and sets LOCAL_WORLD_SIZE, which is what
``local_world_size`` defaults to. Every group here is a new communicator (never the default
group), because the outer exchange may run in a background thread while the training loop
issues collectives on the default group: two threads sharing one communicator could
interleave their collectives differently on different ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moebit.comm import collectives

__all__ = ["OUTER_GROUP_MODES", "OuterGroups", "inner_param_groups", "outer_groups", "outer_layout"]

OUTER_GROUP_MODES = ("node", "world")


@dataclass(frozen=True)
class Layout:
    """Which global ranks form each inner, inner-expert and outer group (pure arithmetic)."""

    inner: list[tuple[int, ...]]
    inner_expert: list[tuple[int, ...]]
    outer: list[tuple[int, ...]]

    @property
    def share(self) -> list[tuple[int, ...]]:
        """The ranks that split one outer exchange: a node's, when it has several."""
        return [g for g in self.inner if len(g) > 1]


def outer_layout(world: int, local: int, mode: str = "node", ep_size: int = 1) -> Layout:
    """The groups for ``world`` ranks, ``local`` per node, as lists of rank tuples.

    world 4, local 2, "node": inner [0,1] [2,3]; outer [0,2] [1,3]. With ep_size 2 the
    inner expert groups are [0] [1] [2] [3] (each node holds one copy of each expert).
    """
    if mode not in OUTER_GROUP_MODES:
        raise ValueError(f"invalid outer_group {mode!r}: expected one of {', '.join(OUTER_GROUP_MODES)}")
    if not isinstance(local, int) or local < 1 or world % local:
        raise ValueError(f"LOCAL_WORLD_SIZE={local!r} must be a positive int dividing the world "
                         f"size {world}")
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    if mode == "world":
        if ep_size > 1:
            raise ValueError(
                f"outer_group='world' with ep_size={ep_size}: expert-parallel ranks share their "
                "experts every step, so they must belong to one DiLoCo worker; use "
                "outer_group='node' with ep_size dividing LOCAL_WORLD_SIZE")
        return Layout([(r,) for r in range(world)], [(r,) for r in range(world)],
                      [tuple(range(world))])
    if local % ep_size:
        raise ValueError(
            f"ep_size={ep_size} must divide LOCAL_WORLD_SIZE={local} with outer_group='node': an "
            "expert-parallel group spanning nodes would spread one worker's experts over "
            "several outer groups")
    nodes = range(0, world, local)
    inner = [tuple(range(n, n + local)) for n in nodes]
    inner_expert = [tuple(range(n + e, n + local, ep_size)) for n in nodes for e in range(ep_size)]
    outer = [tuple(range(j, world, local)) for j in range(local)]
    return Layout(inner, inner_expert, outer)


@dataclass(frozen=True)
class OuterGroups:
    """This rank's groups (see the module docstring) and their global ranks."""

    mode: str
    local_world_size: int
    inner: dist.ProcessGroup | None
    inner_expert: dist.ProcessGroup | None
    outer: dist.ProcessGroup | None
    inner_ranks: tuple[int, ...]
    inner_expert_ranks: tuple[int, ...]
    outer_ranks: tuple[int, ...]
    share: dist.ProcessGroup | None = None  # the node's ranks, for the outer exchange only

    @property
    def workers(self) -> int:
        """How many DiLoCo workers (replicas that drift apart between syncs) there are."""
        return len(self.outer_ranks)


def local_world_size_from_env() -> int:
    """torchrun's LOCAL_WORLD_SIZE, or the whole world (one node) when it is unset."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return collectives.world_size()
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} is not an int") from None


def outer_groups(mode: str = "node", local_world_size: int | None = None,
                 ep_size: int = 1) -> OuterGroups:
    """Create the inner, inner-expert and outer groups; every rank must call this, in the
    same order relative to its other ``dist.new_group`` calls (group creation is collective).

    Without a process group (one process) every group is None and this rank is the only
    worker. Groups are created in a fixed order: all inner groups, all inner-expert groups,
    all outer groups, all share groups.
    """
    local = local_world_size_from_env() if local_world_size is None else local_world_size
    world, me = collectives.world_size(), collectives.rank()
    layout = outer_layout(world, local, mode, ep_size)
    if world == 1 or not dist.is_initialized():
        return OuterGroups(mode, local, None, None, None, (0,), (0,), (0,))
    found: list[Any] = []
    ranks: list[tuple[int, ...]] = []
    for blocks in (layout.inner, layout.inner_expert, layout.outer):
        mine = None
        for b in blocks:
            g = dist.new_group(list(b))
            if me in b:
                mine, mine_ranks = g, b
        found.append(mine)
        ranks.append(mine_ranks)
    share = None
    for b in layout.share:
        g = dist.new_group(list(b))
        if me in b:
            share = g
    return OuterGroups(mode, local, found[0], found[1], found[2], ranks[0], ranks[1], ranks[2],
                       share)


def inner_param_groups(params: Iterable[torch.Tensor], groups: OuterGroups,
                       is_expert: Callable[[torch.Tensor], bool] = lambda p: False,
                       ) -> list[dict[str, Any]]:
    """The inner optimizer's param groups: dense parameters averaged every step over the
    node (``groups.inner``), expert parameters over the node's ranks of their ep rank.

    Pass ``moebit.moe.is_expert_param`` as ``is_expert`` for an MoE model. Empty groups are
    left out; the ``moebit_group`` key names each one, as ``split_params_for_ep`` does.
    """
    dense, expert = [], []
    for p in params:
        (expert if is_expert(p) else dense).append(p)
    out = []
    if dense:
        out.append({"params": dense, "process_group": groups.inner, "moebit_group": "dense"})
    if expert:
        out.append({"params": expert, "process_group": groups.inner_expert,
                    "moebit_group": "expert"})
    return out
