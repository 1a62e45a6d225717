"""Compressed sharded collectives: round trips within their bounds, error feedback,
bytes counted as rs/ag, and a model trained through them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from shard_toys import batch, loss_of, tiny_gpt, world_mean

from moebit.comm import stats
from moebit.testing import run_on_ranks
from moebit.training.shard_comm import (
    CompressedAllGather,
    CompressedReduceScatter,
    dequantize_blocks,
    quantize_blocks,
)
from moebit.training.sharding import ShardConfig, shard_model

CHUNK, QBLOCK = 300, 64  # a chunk that is not a whole number of blocks


def test_block_quantization_error_is_at_most_half_a_step() -> None:
    x = torch.randn(3, 1000) * torch.logspace(-3, 3, 1000)  # blocks of very different range
    codes, scale = quantize_blocks(x, QBLOCK)
    assert codes.dtype == torch.int8 and codes.shape == (3, 1024) and scale.shape == (3, 16)
    err = (dequantize_blocks(codes, scale, 1000) - x).abs()
    step = torch.nn.functional.pad(x.abs(), (0, 24)).view(3, 16, QBLOCK).amax(-1) / 127
    bound = step.repeat_interleave(QBLOCK, dim=1)[:, :1000] / 2
    assert (err <= bound * (1 + 1e-6) + 1e-30).all()
    assert err.max() > 0  # lossy: the test measures something


def _block_amax(x_C: torch.Tensor) -> torch.Tensor:
    """Per element, the max |x| of its quantization block."""
    n_pad = math.ceil(x_C.numel() / QBLOCK) * QBLOCK
    padded = torch.nn.functional.pad(x_C.abs(), (0, n_pad - x_C.numel()))
    return padded.view(-1, QBLOCK).amax(-1).repeat_interleave(QBLOCK)[: x_C.numel()]


def _reduce_scatter(rank: int, world: int, mode: str, repeats: int, feedback: bool):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world * CHUNK, generator=g) * (1 + 10 * rank)
    everyone = torch.empty(world * world * CHUNK)
    dist.all_gather_single(everyone, x)
    chunks = everyone.view(world, world, CHUNK)[:, rank]  # [sender, C]: what I reduce
    exact = chunks.sum(0)
    if mode == "int8":
        bound = sum(_block_amax(c) for c in chunks) / 254
    else:
        bound = chunks.abs().sum(0) * 2.0**-8
    rs = CompressedReduceScatter(mode, QBLOCK, error_feedback=feedback)
    before = stats.snapshot()
    total, worst = torch.zeros(CHUNK), 0.0
    for _ in range(repeats):
        out = torch.empty(CHUNK)
        rs(out, x.clone(), None, dist.ReduceOp.SUM)
        worst = max(worst, ((out - exact).abs() / bound).max().item())
        total += out
    cum = ((total - repeats * exact).abs() / bound).max().item()
    sent = stats.snapshot().minus(before).by_kind()["rs"].bytes_sent / repeats
    return worst, cum, sent


def _all_gather(rank: int, world: int, mode: str):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(CHUNK, generator=g) * (1 + 10 * rank)
    exact = torch.empty(world * CHUNK)
    dist.all_gather_single(exact, x)
    out = torch.empty(world * CHUNK)
    out[rank * CHUNK:(rank + 1) * CHUNK] = x  # FSDP copies this rank's shard in first
    before = stats.snapshot()
    CompressedAllGather(mode, QBLOCK)(out, out[rank * CHUNK:(rank + 1) * CHUNK], None)
    sent = stats.snapshot().minus(before).by_kind()["ag"].bytes_sent
    if mode == "int8":
        bound = torch.cat([_block_amax(c) for c in exact.view(world, CHUNK)]) / 254
    else:
        bound = exact.abs() * 2.0**-8
    return ((out - exact).abs() / bound).max().item(), sent, out


def _collectives(rank: int, world: int) -> dict:
    """Every round trip of this module in one set of ranks (rank start-up dominates)."""
    steps = 12
    return {"rs": {m: _reduce_scatter(rank, world, m, 1, False) for m in ("bf16", "int8")},
            "fb": _reduce_scatter(rank, world, "int8", steps, True),
            "plain": _reduce_scatter(rank, world, "int8", steps, False),
            "ag": {m: _all_gather(rank, world, m) for m in ("bf16", "int8")}, "steps": steps}


@pytest.fixture(scope="module")
def collectives() -> list[dict]:
    return run_on_ranks(_collectives, 2, timeout=180)


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_compressed_reduce_scatter_stays_within_its_bound(collectives, mode: str) -> None:
    for out in collectives:
        worst, _, sent = out["rs"][mode]
        assert 0 < worst <= 1.0 + 1e-4
        exact_bytes = CHUNK * 4  # (world - 1) chunks of fp32
        want = CHUNK * 2 if mode == "bf16" else 320 + 5 * 4
        assert sent == want and sent < (0.55 if mode == "bf16" else 0.3) * exact_bytes


def test_int8_error_feedback_keeps_the_running_sum_within_one_steps_error(collectives) -> None:
    for out in collectives:
        (_, cum_fb, _), (worst, cum_plain, _) = out["fb"], out["plain"]
        assert cum_fb <= 1.0 + 1e-3  # the residual carries what was dropped
        assert cum_plain > 0.99 * out["steps"] * worst  # without it the same error adds up


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_compressed_all_gather_stays_within_its_bound_and_agrees_on_every_rank(
        collectives, mode: str) -> None:
    for out in collectives:
        worst, sent, gathered = out["ag"][mode]
        assert 0 < worst <= 1.0 + 1e-4
        assert sent == (CHUNK * 2 if mode == "bf16" else 320 + 5 * 4)
        assert torch.equal(gathered, collectives[0]["ag"][mode][2])  # same weights everywhere


def _train(rank: int, world: int, rs: str, ag: str, steps: int, param_dtype=None):
    cfg = ShardConfig("fsdp", rs_compress=rs, ag_compress=ag, quant_block=QBLOCK,
                      param_dtype=param_dtype, reduce_dtype="fp32" if param_dtype else None)
    model = shard_model(tiny_gpt(d_model=32), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats.reset()
    losses = []
    for step in range(steps):
        loss = loss_of(model, batch(rank, step % 2))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(world_mean(loss.detach()))
    kinds = stats.snapshot().by_kind()
    if param_dtype:  # the optimizer's master shards stay fp32; gradients arrive in fp32
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        loss_of(model, batch(rank, 0)).backward()
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    return losses, kinds["rs"].bytes_sent, kinds["ag"].bytes_sent


def _both(rank: int, world: int):
    return (*_train(rank, world, "none", "none", 10), *_train(rank, world, "int8", "int8", 10),
            *_train(rank, world, "none", "none", 10, "bf16"))


@pytest.fixture(scope="module")
def trained() -> tuple:
    return run_on_ranks(_both, 2, timeout=300)[0]


def test_training_through_int8_collectives_follows_the_exact_run(trained) -> None:
    exact, rs_exact, ag_exact, q, rs_q, ag_q = trained[:6]
    assert q[-1] < q[0] - 0.5  # it trains
    assert max(abs(a - b) for a, b in zip(exact, q, strict=True)) < 0.05 * exact[0]
    assert 0 < rs_q < 0.3 * rs_exact and 0 < ag_q < 0.3 * ag_exact


def test_bf16_mixed_precision_gathers_half_the_bytes_and_follows_fp32(trained) -> None:
    exact, rs_exact, ag_exact = trained[:3]
    bf16, rs_bf16, ag_bf16 = trained[6:]
    assert ag_bf16 == ag_exact // 2  # parameters are gathered in bf16
    assert rs_bf16 == rs_exact  # reduce_dtype fp32: gradients are reduced in fp32
    assert bf16[-1] < bf16[0] - 0.5
    assert max(abs(a - b) for a, b in zip(exact, bf16, strict=True)) < 0.05 * exact[0]
