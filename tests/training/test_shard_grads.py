"""Sharded gradients and losses equal the replicated ones (dense fsdp, hsdp, ep x efsdp)."""

from __future__ import annotations

import torch
from shard_toys import batch, local, loss_of, replicated_step, tiny_gpt, world_mean

from moebit.testing import run_on_ranks
from moebit.training.sharding import ShardConfig, shard_model


def _grads(rank: int, world: int, shard: str, ep: int, node: int) -> float:
    ref = tiny_gpt(ep)
    model = shard_model(tiny_gpt(ep), ShardConfig(shard=shard, local_world_size=node))
    replicated_step(ref, batch(rank, 0))
    loss_of(model, batch(rank, 0)).backward()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        g, want = local(p.grad), q.grad
        assert g.shape == want.shape, (name, g.shape, want.shape)
        worst = max(worst, (g - want).abs().max().item() / (want.abs().max().item() + 1e-12))
    return worst


def test_fsdp_dense_gradients_equal_the_averaged_replicated_ones() -> None:
    assert max(run_on_ranks(_grads, 2, args=("fsdp", 0, 0), timeout=120)) < 1e-5


def test_ep2_by_efsdp2_gradients_equal_the_replicated_ones_on_4_ranks() -> None:
    assert max(run_on_ranks(_grads, 4, args=("fsdp", 2, 0), timeout=180)) < 1e-5


def test_hsdp_moe_gradients_equal_the_replicated_ones_on_2_nodes_of_2() -> None:
    assert max(run_on_ranks(_grads, 4, args=("hsdp", 2, 2), timeout=180)) < 1e-5


def _losses(rank: int, world: int, ep: int, steps: int) -> tuple[list[float], list[float]]:
    ref = tiny_gpt(ep)
    model = shard_model(tiny_gpt(ep), ShardConfig(shard="fsdp"))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
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


def test_sharded_loss_equals_the_replicated_runs_over_10_steps() -> None:
    want, got = run_on_ranks(_losses, 2, args=(0, 10), timeout=180)[0]
    assert want[-1] < want[0]  # it trains
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-5, (want, got)


def test_sharded_moe_loss_equals_the_replicated_runs_over_10_steps() -> None:
    want, got = run_on_ranks(_losses, 4, args=(2, 10), timeout=240)[0]
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-5, (want, got)
