"""Sharded vs replicated: gradients and losses are equal (dense fsdp, hsdp, ep x efsdp,
Adam and LAMB), and each rank holds a quarter of the state at 4 ranks."""

from __future__ import annotations

import pytest
import torch
from shard_toys import batch, local, loss_of, replicated_step, tiny_gpt, tiny_hf, world_mean

from moebit.comm import stats
from moebit.models.gpt import GPT, GPTConfig
from moebit.optim.lamb import Lamb
from moebit.testing import run_on_ranks
from moebit.training.shard_memory import StateBytes, peak_rss_mb, state_bytes_per_rank
from moebit.training.sharding import ShardConfig, make_meshes, shard_model


def _grads(rank: int, world: int, shard: str, ep: int, node: int, make=tiny_gpt,
           **settings) -> float:
    ref = make(ep)
    model = shard_model(make(ep), ShardConfig(shard=shard, local_world_size=node, **settings))
    replicated_step(ref, batch(rank, 0))
    loss_of(model, batch(rank, 0)).backward()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        g, want = local(p.grad), q.grad
        assert g.shape == want.shape, (name, g.shape, want.shape)
        worst = max(worst, (g - want).abs().max().item() / (want.abs().max().item() + 1e-12))
    return worst


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "lamb":
        return Lamb(model.parameters(), lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _losses(rank: int, world: int, ep: int, steps: int, optimizer: str = "adam",
            **settings) -> tuple[list[float], list[float]]:
    ref = tiny_gpt(ep)
    model = shard_model(tiny_gpt(ep), ShardConfig(shard="fsdp", **settings))
    opt_ref, opt = _optimizer(optimizer, ref), _optimizer(optimizer, model)
    want, got = [], []
    for step in range(steps):
        x = batch(rank, step % 2)  # two batches per rank, seen again: the loss must fall
        want.append(replicated_step(ref, x))
        opt_ref.step()
        opt_ref.zero_grad()
        loss = loss_of(model, x)
        loss.backward()
        got.append(world_mean(loss.detach()))
        opt.step()
        opt.zero_grad()
    return want, got


def _held(model: torch.nn.Module, rank: int) -> StateBytes:
    """What the rank holds after one AdamW step (gradients still present)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_of(model, batch(rank, 0)).backward()
    opt.step()
    return state_bytes_per_rank(model, opt)


def _memory(rank: int, world: int) -> dict:
    """Sharded (dense; ep 2 x efsdp 2) against one replica holding the whole model."""
    out = {}
    for ep, whole in ((0, 0), (2, 1)):
        replicated = _held(tiny_gpt(whole), rank)
        sharded = _held(shard_model(tiny_gpt(ep), ShardConfig(shard="fsdp")), rank)
        out[ep] = (sharded, replicated)
    out["rss"] = peak_rss_mb()
    return out


def _message(fn, *args, **kw) -> str:
    try:
        fn(*args, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


def _refusals(rank: int, world: int) -> dict[str, str]:
    """What shard_model refuses on the ranks (the pure layout checks: test_shard_errors)."""
    torch.manual_seed(0)  # 2 experts over ep 2: one local expert, 2 efsdp ranks
    uneven = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=16, num_experts=2,
                           moe={"ep_size": 2}))
    out = {"uneven": _message(shard_model, uneven, ShardConfig("fsdp")),
           "ep": _message(make_meshes, ShardConfig("fsdp"), ep_size=3)}
    out["meshes"] = _message(shard_model, tiny_gpt(ep=2), ShardConfig("fsdp"),
                             make_meshes(ShardConfig("fsdp"), ep_size=1))
    dense = shard_model(tiny_gpt(), ShardConfig("fsdp"))
    out["twice"] = _message(shard_model, dense, ShardConfig("fsdp"))
    return out


def _two(rank: int, world: int) -> dict:
    """The dense checks on 2 ranks, in one start-up."""
    return {"grads": _grads(rank, world, "fsdp", 0, 0), "losses": _losses(rank, world, 0, 10),
            "lamb": _losses(rank, world, 0, 6, "lamb"),
            # one unit, kept gathered from forward to backward, through each transport
            "model_unit": [_losses(rank, world, 0, 10, unit="model", reshard_after_forward=False,
                                   transport=t) for t in ("native", "a2a")],
            "block_a2a": _grads(rank, world, "fsdp", 0, 0, transport="a2a")}


def _four(rank: int, world: int) -> dict:
    """The expert-parallel checks on 4 ranks (ep 2 x efsdp 2; hsdp 2 nodes of 2)."""
    return {"grads": _grads(rank, world, "fsdp", 2, 0),
            "hsdp_grads": _grads(rank, world, "hsdp", 2, 2),
            "hf_grads": _grads(rank, world, "fsdp", 2, 0, tiny_hf),
            "model_grads": [_grads(rank, world, "fsdp", 2, 0, unit="model", transport="a2a"),
                            _grads(rank, world, "hsdp", 2, 2, unit="model"),
                            _grads(rank, world, "fsdp", 2, 0, tiny_hf, unit="model",
                                   reshard_after_forward=False)],
            "replicate_allreduces": stats.snapshot().ops["fsdp.allreduce.replicate"].calls,
            "losses": _losses(rank, world, 2, 10), "memory": _memory(rank, world),
            "refusals": _refusals(rank, world)}


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_on_ranks(_two, 2, timeout=180)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_on_ranks(_four, 4, timeout=300)


def test_fsdp_dense_gradients_equal_the_averaged_replicated_ones(two) -> None:
    assert max(r["grads"] for r in two) < 1e-5


def test_ep2_by_efsdp2_gradients_equal_the_replicated_ones_on_4_ranks(four) -> None:
    assert max(r["grads"] for r in four) < 1e-5


def test_hf_decoder_ep2_by_efsdp2_gradients_equal_the_replicated_ones(four) -> None:
    assert max(r["hf_grads"] for r in four) < 1e-5  # Qwen3-MoE: every layer routed


def test_hsdp_moe_gradients_equal_the_replicated_ones_on_2_nodes_of_2(four) -> None:
    assert max(r["hsdp_grads"] for r in four) < 1e-5
    assert all(r["replicate_allreduces"] > 0 for r in four)  # counted across the nodes


def test_sharded_loss_equals_the_replicated_runs_over_10_steps(two) -> None:
    want, got = two[0]["losses"]
    assert want[-1] < want[0] - 0.5  # it trains
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-5, (want, got)


def test_sharded_moe_loss_equals_the_replicated_runs_over_10_steps(four) -> None:
    want, got = four[0]["losses"]
    assert want[-1] < want[0] - 0.5
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-5, (want, got)


def test_one_unit_kept_gathered_trains_as_the_replicated_run_through_either_transport(two
                                                                                    ) -> None:
    for want, got in two[0]["model_unit"]:
        assert want[-1] < want[0] - 0.5
        assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-5, (want, got)
    assert max(r["block_a2a"] for r in two) < 1e-5  # the all-to-all reduce-scatter averages


def test_one_unit_per_mesh_gives_the_replicated_gradients_with_experts(four) -> None:
    for r in four:  # ep 2 x efsdp 2 (a2a); hsdp 2 nodes of 2; Qwen3-MoE without resharding
        assert max(r["model_grads"]) < 1e-5, r["model_grads"]


def test_lamb_under_fsdp_equals_replicated_lamb(two) -> None:
    want, got = two[0]["lamb"]  # its trust ratios take whole-tensor norms of the shards
    assert want[-1] < want[0]
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-5, (want, got)


@pytest.mark.parametrize("ep", [0, 2])
def test_state_bytes_per_rank_sharded_is_under_0_3x_replicated_at_4_ranks(four, ep) -> None:
    for r in four:
        sharded, replicated = r["memory"][ep]
        for part in ("params", "grads", "optimizer"):
            assert 0 < getattr(sharded, part) <= 0.3 * getattr(replicated, part), part
        assert sharded.total <= 0.3 * replicated.total
        # Adam: two moments of every parameter, plus one step counter per tensor
        assert sharded.optimizer >= 2 * sharded.params
        assert r["memory"]["rss"] > 10


def test_impossible_sharding_is_refused_on_the_ranks_in_one_line(four) -> None:
    for r in four:
        m = r["refusals"]
        assert m["uneven"].startswith("blocks.1.ffn.experts.w1: 1 local experts do not split "
                                      "over the 2 expert-data-parallel ranks")
        assert m["ep"] == "ep_size=3 does not divide the world size 4"
        assert m["meshes"] == "meshes were made for ep_size=1, the model has 2"
        assert m["twice"] == "shard_model: the model is already sharded"
        assert not any("\n" in v for v in m.values())
