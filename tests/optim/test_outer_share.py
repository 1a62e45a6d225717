"""Two nodes of 2 gloo ranks: a node's ranks split each outer exchange (the share group).

Each rank exchanges its slice of the node's dense pseudo-gradient over its outer group and
the node all-gathers the averages: the result must equal the whole exchange, with half the
bytes per rank on the outer group.
"""

from __future__ import annotations

import pytest
import torch

from moebit.comm import stats
from moebit.comm.outer_groups import inner_param_groups, outer_groups
from moebit.optim import OuterOptimizer
from moebit.testing import run_on_ranks

from toys import flat_params, regression_batch, regression_mlp


def _outer_bytes() -> int:
    return stats.snapshot().by_kind().get("outer", stats.OpStats()).bytes_sent


def _body(rank: int, world: int) -> dict:
    groups = outer_groups("node", local_world_size=2)
    node = rank // 2
    out: dict = {"share_size": groups.share.size()}
    # A node's replica: the same delta on both of its ranks, another on the other node.
    delta = torch.randn(10_000, generator=torch.Generator().manual_seed(node)) * (1 + node)
    model = regression_mlp()
    opt = torch.optim.SGD(inner_param_groups(model.parameters(), groups), lr=0.1)
    for compress in ("none", "int8", "1bit"):
        whole = OuterOptimizer(opt, model.parameters(), groups.outer, every=2, compress=compress)
        split = OuterOptimizer(opt, model.parameters(), groups.outer, every=2, compress=compress,
                               share=groups.share)
        b0 = _outer_bytes()
        a = whole._average_dense(delta, "f")
        b1 = _outer_bytes()
        b = split._average_dense(delta, "f")
        b2 = _outer_bytes()
        out[compress] = (a, b, b1 - b0, b2 - b1)
    # Training: after each sync all four ranks hold one point; between, the nodes differ.
    outer = OuterOptimizer(opt, model.parameters(), groups.outer, every=3, compress="1bit",
                           share=groups.share)
    points = []
    for t in range(6):
        x, y = regression_batch(node, t)  # the node's ranks see the same data here
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        outer.step()
        points.append(flat_params(model))
    out["points"] = points
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_body, 4, timeout=150)


def test_the_share_group_is_the_node(ranks):
    assert all(r["share_size"] == 2 for r in ranks)


@pytest.mark.parametrize("compress", ["none", "int8", "1bit"])
def test_a_split_exchange_equals_the_whole_one(ranks, compress):
    for r in ranks:
        whole, split, _, _ = r[compress]
        assert torch.allclose(whole, split, rtol=0, atol=1e-6), compress
        torch.testing.assert_close(whole, ranks[0][compress][0])


@pytest.mark.parametrize("compress", ["none", "int8", "1bit"])
def test_each_rank_sends_half(ranks, compress):
    for r in ranks:
        _, _, sent_whole, sent_split = r[compress]
        assert 0.4 < sent_split / sent_whole < 0.6, (compress, sent_split, sent_whole)


def test_all_ranks_agree_after_every_sync(ranks):
    for t in range(6):
        pts = [r["points"][t] for r in ranks]
        assert torch.equal(pts[0], pts[1])  # a node's ranks: the same replica
        if (t + 1) % 3 == 0:
            assert all(torch.equal(pts[0], p) for p in pts[1:]), t
        else:
            assert not torch.equal(pts[0], pts[2]), t
