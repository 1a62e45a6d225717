"""The 1-bit allreduce with a scale per block: every rank gets the same average, the error
feedback drives the running mean to the exact average, a block's scale follows its own
magnitude (where one scale per chunk does not), and the error buffers resume exactly."""

from __future__ import annotations

import pytest
import torch

from moebit.comm import stats
from moebit.comm.compressed import OnebitAllreduce
from moebit.comm.onebit_blocks import BlockOnebitAllreduce
from moebit.testing import run_on_ranks

N = 3000  # not a multiple of W * block: the padding is exercised
SMALL = 23 * 64  # whole blocks of small elements (a block that straddles both takes the big scale)


def _x(rank: int, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + call)
    x = torch.randn(N, generator=g)
    x[:SMALL] *= 1e-3  # two magnitudes, as a LayerNorm gain beside an attention matrix
    return x


def _ranks(rank: int, world: int) -> dict:
    ar = BlockOnebitAllreduce(block=64, op_prefix="test.blocks")
    chunky = OnebitAllreduce(op_prefix="test.chunks")
    exact = sum(_x(r, 0) for r in range(world)) / world
    outs, chunk_outs = [], []
    for _ in range(40):  # the same input every call: the running mean must converge
        outs.append(ar.allreduce(_x(rank, 0), "a"))
        chunk_outs.append(chunky.allreduce(_x(rank, 0), "a"))
    saved = ar.state_dict()
    after = ar.allreduce(_x(rank, 1), "a")
    again = BlockOnebitAllreduce(block=64)
    again.load_state_dict(saved)
    resumed = again.allreduce(_x(rank, 1), "a")
    small = slice(0, SMALL)

    def rel(y: torch.Tensor) -> float:
        return float((y[small] - exact[small]).norm() / exact[small].norm())

    return {"first": outs[0], "exact": exact,
            "mean_err": float((torch.stack(outs).mean(0) - exact).norm() / exact.norm()),
            "first_err": float((outs[0] - exact).norm() / exact.norm()),
            "small_err": rel(outs[0]), "small_err_chunks": rel(chunk_outs[0]),
            "after": after, "resumed": resumed,
            "bytes": stats.snapshot().ops["test.blocks.phase1"].bytes_sent}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_ranks, 3, timeout=120)


def test_every_rank_decodes_the_same_average(ranks) -> None:
    for r in ranks[1:]:
        assert torch.equal(r["first"], ranks[0]["first"])


def test_error_feedback_drives_the_running_mean_to_the_exact_average(ranks) -> None:
    r = ranks[0]
    assert r["first_err"] > 0.2  # one call is far off: 1 bit per element
    assert r["mean_err"] < 0.25 * r["first_err"]  # about 1/T: 0.72 -> 0.15 over 40 calls


def test_a_block_scale_follows_its_own_magnitude(ranks) -> None:
    r = ranks[0]  # the small half: per-block scales stay near it, one chunk scale does not
    assert r["small_err"] < 1.0 < r["small_err_chunks"]


def test_saved_error_buffers_resume_exactly(ranks) -> None:
    for r in ranks:
        assert torch.equal(r["after"], r["resumed"])


def test_bytes_are_the_signs_and_the_block_scales(ranks) -> None:
    chunk = 1024  # 3000 over 3 ranks in whole blocks of 64: 16 blocks each
    assert ranks[0]["bytes"] == 41 * 2 * (chunk // 8 + 4 * (chunk // 64))  # 41 calls, 2 peers


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        BlockOnebitAllreduce(block=12)
    with pytest.raises(ValueError, match="1-D float32"):
        BlockOnebitAllreduce().allreduce(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="blocks of 64 elements, this run uses 256"):
        BlockOnebitAllreduce().load_state_dict({"block": 64, "buffers": {}})
