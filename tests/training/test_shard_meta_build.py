"""A sharded model built on the meta device (``shard_build.build_sharded``) starts from
exactly the replicated build's weights, buffers and RNG state (dense fsdp and hsdp,
experts over ep 2 x efsdp 2, moebit's GPT and a Hugging Face family), and no rank holds
the full model while building it (every CPU tensor the build touched, measured live)."""

from __future__ import annotations

import pytest
import torch
from shard_toys import HF_QWEN3_MOE, local, tiny_gpt, tiny_hf

from moebit.models.gpt import GPT, GPTConfig
from moebit.models.hf import HFDecoder, HFDecoderConfig
from moebit.testing import run_on_ranks
from moebit.training.meta_init import MetaBuildError, record_build, replay, targets
from moebit.training.shard_config import ShardConfig

WORLD = 4
# name -> (replicated model maker, its shard config); each replicated maker seeds itself
CASES = {
    "gpt-fsdp": (lambda: tiny_gpt(0), ShardConfig(shard="fsdp")),
    "gpt-hsdp": (lambda: tiny_gpt(0), ShardConfig(shard="hsdp", local_world_size=2)),
    "gpt-ep2-efsdp2": (lambda: tiny_gpt(2), ShardConfig(shard="fsdp")),
    "qwen3_moe-ep2-efsdp2": (lambda: tiny_hf(2), ShardConfig(shard="fsdp")),
    "qwen3_moe-tied-fsdp": (
        lambda: (torch.manual_seed(0), HFDecoder(HFDecoderConfig.from_hf(
            {**HF_QWEN3_MOE, "tie_word_embeddings": True})))[1],
        ShardConfig(shard="fsdp")),
}
BIG = GPTConfig(n_layer=8, n_head=4, d_model=128, block_size=32)  # 6.5 MB of fp32 weights


def _differences(ref: torch.nn.Module, model: torch.nn.Module) -> list[str]:
    """Names whose sharded (gathered) value is not bit-equal to the replicated one."""
    bad = []
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if not torch.equal(local(p.detach()), q.detach()):
            bad.append(name)
    for (name, b), (_, c) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        if not torch.equal(b, c):
            bad.append(name)
    return bad


def _same_start(make, scfg: ShardConfig) -> dict:
    from moebit.training.shard_build import build_sharded

    ref = make()
    rng_after = torch.get_rng_state()
    torch.manual_seed(0)  # the seed every maker starts from
    model, report = build_sharded(ref.config, scfg)
    return {"bad": _differences(ref, model), "rng": torch.equal(torch.get_rng_state(), rng_after),
            "tied": (model.lm_head.weight is model.wte.weight) == (ref.lm_head.weight is ref.wte.weight),
            "filled": report.filled}


def _live_bytes() -> dict:
    from moebit.training.shard_build import build_sharded
    from moebit.training.shard_memory import LiveTensorBytes, state_bytes_per_rank

    torch.manual_seed(0)
    with LiveTensorBytes() as replicated:
        ref = GPT(BIG)
    sizes = [p.numel() * p.element_size() for p in ref.parameters()]
    del ref
    torch.manual_seed(0)
    with LiveTensorBytes() as sharded:
        model, report = build_sharded(BIG, ShardConfig(shard="fsdp"))
    return {"full": sum(sizes), "largest": max(sizes), "replicated_peak": replicated.peak,
            "peak": sharded.peak, "shards": state_bytes_per_rank(model).params,
            "replay_peak": report.peak_bytes}


def _pool(rank: int, world: int) -> dict:
    out = {name: _same_start(make, scfg) for name, (make, scfg) in CASES.items()}
    out["memory"] = _live_bytes()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_pool, WORLD, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_the_meta_build_starts_bit_identical_to_the_replicated_build(ranks, case) -> None:
    for rank, got in enumerate(ranks):
        res = got[case]
        assert res["bad"] == [], (rank, res["bad"])
        assert res["rng"], f"rank {rank}: the RNG is not where the replicated build leaves it"
        assert res["tied"] and res["filled"] > 0


def test_no_rank_holds_the_full_model_while_building(ranks) -> None:
    for m in (got["memory"] for got in ranks):
        # the meter sees a full build: the replicated build holds every weight at once
        assert m["replicated_peak"] >= m["full"]
        assert m["shards"] <= m["full"] / WORLD * 1.01
        # this rank's shards plus one full tensor at a time (and the buffers' few bytes)
        assert m["peak"] <= m["shards"] + m["largest"] + 64 * 1024, m
        assert m["peak"] < 0.35 * m["full"], m
        assert m["replay_peak"] <= m["largest"]


def test_a_replay_without_sharding_rebuilds_the_same_model() -> None:
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8, num_experts=4,
                    moe={"num_experts_per_tok": 2})
    torch.manual_seed(3)
    ref = GPT(cfg)
    torch.manual_seed(3)
    with torch.device("meta"):
        model, record = record_build(lambda: GPT(cfg))
    wanted = targets(model, record)
    model.to_empty(device="cpu")  # unties the embedding and the head (FSDP2's does not)
    with pytest.raises(MetaBuildError, match="wte.weight and lm_head.weight were tied"):
        replay(record, model, wanted)
    model.lm_head.weight = model.wte.weight
    replay(record, model, wanted)
    assert _differences(ref, model) == []


def test_a_build_the_replay_cannot_follow_is_refused_by_name() -> None:
    def own_generator() -> torch.nn.Module:
        with torch.device("meta"):
            lin = torch.nn.Linear(4, 4)
            with torch.no_grad():
                lin.weight.normal_(generator=torch.Generator())
        return lin

    def real_draw() -> torch.nn.Module:
        with torch.device("meta"):
            lin = torch.nn.Linear(4, 4)
        lin.bias.data = torch.randn(4, device="cpu")
        return lin

    with pytest.raises(MetaBuildError, match="own torch.Generator"):
        record_build(own_generator)
    with pytest.raises(MetaBuildError, match="real cpu tensor"):
        record_build(real_draw)
