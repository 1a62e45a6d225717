"""The two-level topology (moebit.comm.outer_groups): the layout arithmetic, and DiLoCo on
4 gloo ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2), with one expert per ep rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moebit.comm.outer_groups import inner_param_groups, outer_groups, outer_layout
from moebit.moe import is_expert_param
from moebit.optim import OuterOptimizer
from moebit.testing import run_on_ranks
from moebit.training.grads import average_gradients

TIMEOUT = 150


def test_node_layout_pairs_the_same_local_rank_across_nodes():
    lay = outer_layout(8, 4, "node", ep_size=2)
    assert lay.inner == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert lay.inner_expert == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.outer == [(0, 4), (1, 5), (2, 6), (3, 7)]
    world = outer_layout(4, 2, "world")
    assert world.inner == [(0,), (1,), (2,), (3,)] and world.outer == [(0, 1, 2, 3)]


@pytest.mark.parametrize("args,key", [
    ((6, 4, "node"), "LOCAL_WORLD_SIZE=4"),
    ((4, 2, "ring"), "outer_group"),
    ((8, 4, "node", 3), "ep_size=3 must divide LOCAL_WORLD_SIZE=4"),
    ((4, 2, "world", 2), "outer_group='world' with ep_size=2"),
])
def test_layout_errors_name_the_setting(args, key):
    with pytest.raises(ValueError, match=key.replace("(", r"\(")) as e:
        outer_layout(*args)
    assert "\n" not in str(e.value)


class _Toy(nn.Module):
    """A dense layer and one "expert" weight: ep rank e holds expert e (another init)."""

    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 4)
        torch.manual_seed(10 + ep_rank)
        self.expert = nn.Parameter(torch.randn(4, 4))
        self.expert.moebit_expert = True  # what moebit.moe marks its expert weights with

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x)) @ self.expert


COMPRESSIONS = ("int8", "1bit")  # both mix dense and expert values unless kept apart


def _two_nodes(rank: int, world: int) -> dict:
    groups = outer_groups("node", ep_size=2)
    out = {"ranks": (groups.inner_ranks, groups.inner_expert_ranks, groups.outer_ranks)}
    for compress in COMPRESSIONS:
        out[compress] = _run(rank, groups, compress)
    return out


def _run(rank: int, groups, compress: str) -> list:
    model = _Toy(ep_rank=rank % 2)
    opt = torch.optim.AdamW(inner_param_groups(model.parameters(), groups, is_expert_param),
                            lr=1e-2)
    outer = OuterOptimizer(opt, [model.dense, [model.expert]], groups.outer, every=3,
                           compress=compress)
    steps = []
    for t in range(7):
        g = torch.Generator().manual_seed(100 * rank + t)
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        average_gradients(opt)  # what the loop does: each group over its process group
        opt.step()
        rec = outer.step()
        steps.append((t + 1, rec is not None, model.dense.weight.detach().clone(),
                      model.expert.detach().clone()))
    return steps


@pytest.fixture(scope="module")
def nodes() -> list[dict]:
    return run_on_ranks(_two_nodes, world=4, timeout=TIMEOUT, env={"LOCAL_WORLD_SIZE": "2"})


def test_groups_on_two_nodes_of_two(nodes):
    assert [n["ranks"] for n in nodes] == [
        ((0, 1), (0,), (0, 2)), ((0, 1), (1,), (1, 3)),
        ((2, 3), (2,), (0, 2)), ((2, 3), (3,), (1, 3))]


@pytest.mark.parametrize("compress", COMPRESSIONS)
def test_dense_agrees_in_a_node_every_step_and_everywhere_after_a_sync(nodes, compress):
    for i, (step, synced, *_rest) in enumerate(nodes[0][compress]):
        dense = [n[compress][i][2] for n in nodes]
        assert torch.equal(dense[0], dense[1]) and torch.equal(dense[2], dense[3])
        assert synced == (step in (3, 6))
        assert torch.equal(dense[0], dense[2]) == synced, step  # nodes drift between syncs


@pytest.mark.parametrize("compress", COMPRESSIONS)
def test_experts_sync_over_the_ranks_that_hold_them(nodes, compress):
    for i, (step, synced, *_rest) in enumerate(nodes[0][compress]):
        expert = [n[compress][i][3] for n in nodes]
        assert not torch.equal(expert[0], expert[1])  # different experts
        assert torch.equal(expert[0], expert[2]) == synced, step
        assert torch.equal(expert[1], expert[3]) == synced, step
