"""Aux-loss-free balancing on real gloo ranks: replicas apply the same bias update (dp 2,
ep 2 x dp 2), and in the training loop the bias is checkpointed and resumes bit-exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moebit.testing import run_on_ranks
from moebit.training.config import build

TIMEOUT = 120
SPEED = 0.05


def _layer_body(rank: int, world: int, ep_size: int) -> dict[str, object]:
    from moebit.moe import MoE, MoEConfig, expert_parallel_groups, update_router_biases_

    groups = expert_parallel_groups(ep_size) if ep_size > 1 else None
    torch.manual_seed(0)  # the same router on every rank
    moe = MoE(8, MoEConfig(num_experts=4, num_experts_per_tok=2, drop_tokens=False, d_ffn=8,
                           ep_size=ep_size, bias_update_speed=SPEED), groups)
    g = torch.Generator().manual_seed(100 + rank)  # every rank routes its own tokens
    counts, biases = [], []
    for _ in range(3):
        out = moe(torch.randn(2, 16, 8, generator=g))
        counts.append(out.stats.tokens_per_expert.clone())
        update_router_biases_(moe)
        biases.append(moe.gate.e_score_correction_bias.clone())
    return {"counts": counts, "biases": biases}


@pytest.mark.parametrize(("world", "ep_size"), [(2, 1), (4, 2)])
def test_replicas_apply_the_same_update_from_the_summed_load(world: int, ep_size: int) -> None:
    res = run_on_ranks(_layer_body, world=world, args=(ep_size,), timeout=TIMEOUT)
    expected = torch.zeros(4)
    for step in range(3):
        total = sum(r["counts"][step] for r in res).float()  # summed over every rank
        expected = expected + SPEED * torch.sign(total.mean() - total)
        for r in res:
            assert torch.equal(r["biases"][step], res[0]["biases"][step])
        assert torch.allclose(res[0]["biases"][step], expected)
    # the ranks saw different loads, so the shared update is not any one rank's own
    assert any(not torch.equal(res[0]["counts"][s], res[1]["counts"][s]) for s in range(3))


def _train(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train as _train

    return _train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def _cfg(corpus: Path, **kw) -> dict:
    cfg = {"data": str(corpus), "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
           "batch_size": 4, "steps": 8, "lr": 3e-3, "warmup_steps": 0, "min_lr_ratio": 1.0,
           "eval_every": 100, "eval_batches": 1, "log_every": 4, "dtype": "fp32", "samples": 0,
           "num_experts": 4, "num_experts_per_tok": 2, "ep_size": 2, "scoring_func": "sigmoid",
           "bias_update_speed": 1e-2, "router_aux_loss_coef": 0.0}
    cfg.update(kw)
    return cfg


def test_training_keeps_biases_identical_and_resumes_them_exactly(
    small_corpus: Path, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    run_on_ranks(_train, 2, args=(_cfg(small_corpus), str(a)), timeout=TIMEOUT)
    run_on_ranks(_train, 2, args=(_cfg(small_corpus, steps=4), str(b)), timeout=TIMEOUT)
    run_on_ranks(_train, 2, args=(_cfg(small_corpus, resume=True), str(b)), timeout=TIMEOUT)
    key = "blocks.1.ffn.gate.e_score_correction_bias"
    shards = {(run, r): torch.load(run / "checkpoints/step-00000008" / f"rank-0000{r}.pt",
                                   weights_only=True)["model"] for run in (a, b) for r in (0, 1)}
    bias = shards[(a, 0)][key]
    assert bias.abs().sum() > 0  # it moved
    for s in shards.values():
        assert torch.equal(s[key], bias)  # both ranks, straight and resumed
    recs = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert len(train[-1]["router_bias"]) == 1 and len(train[-1]["router_bias"][0]) == 4
    assert train[-1]["load_max_over_mean"][0] >= 1.0
