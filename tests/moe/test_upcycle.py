"""Sparse upcycling: copies of the dense MLP reproduce the dense model, and training an
upcycled run resumes from the dense loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moebit.cli.upcycle import main as upcycle_main
from moebit.inference.generate import dropless
from moebit.inference.loading import load_model
from moebit.models.gpt import GPT, GPTConfig
from moebit.testing import run_on_ranks
from moebit.training.config import build
from moebit.upcycle.runs import upcycle, upcycle_state_dict, weights_sum_to_one

BASE = {"block_size": 16, "n_layer": 2, "n_head": 2, "d_model": 16}


def _dense() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE))
    with torch.no_grad():  # non-zero biases, so that copying them is tested too
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("moe", [
    {"num_experts_per_tok": 2},
    {"num_experts_per_tok": 3, "scoring_func": "sigmoid", "bias_update_speed": 1e-3},
    {"num_experts_per_tok": 1, "softmax_before_topk": False},
    {"num_experts_per_tok": 1, "softmax_before_topk": False, "residual": True},
])
def test_upcycled_copies_reproduce_the_dense_model(moe: dict) -> None:
    dense = _dense()
    cfg = GPTConfig(**BASE, num_experts=4, moe_every=1, moe={"drop_tokens": False, **moe})
    assert weights_sum_to_one(cfg)
    upcycled = GPT(cfg)
    upcycled.load_state_dict(upcycle_state_dict(dense.state_dict(), cfg, seed=1))
    upcycled.eval()
    x = torch.randint(0, 256, (3, 16))
    with torch.no_grad():
        want, got = dense(x).logits, upcycled(x).logits
    assert torch.allclose(got, want, atol=1e-5)
    router = upcycled.blocks[0].ffn.gate if not moe.get("residual") else \
        upcycled.blocks[0].ffn.moe.gate
    assert 0 < router.router.weight.abs().max() < 0.01  # near zero, not zero


def test_top1_softmax_first_and_noise_do_not_reproduce() -> None:
    dense = _dense()
    x = torch.randint(0, 256, (2, 16))
    for moe, noise in (({"num_experts_per_tok": 1}, 0.0), ({"num_experts_per_tok": 2}, 0.05)):
        cfg = GPTConfig(**BASE, num_experts=4, moe_every=1, moe={"drop_tokens": False, **moe})
        upcycled = GPT(cfg)
        upcycled.load_state_dict(upcycle_state_dict(dense.state_dict(), cfg, noise_std=noise))
        with torch.no_grad():
            assert not torch.allclose(upcycled.eval()(x).logits, dense(x).logits, atol=1e-3)
    assert not weights_sum_to_one(GPTConfig(**BASE, num_experts=4, moe={}))


def test_foreign_state_dict_is_named() -> None:
    sd = _dense().state_dict()
    del sd["blocks.0.attn.qkv.weight"]
    cfg = GPTConfig(**BASE, num_experts=4, moe_every=2, moe={})
    with pytest.raises(ValueError, match="blocks.0.attn.qkv.weight"):
        upcycle_state_dict(sd, cfg)


def _train(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train as _train

    return _train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def _losses(run: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]


def test_upcycled_run_resumes_from_the_dense_loss(small_corpus: Path, tmp_path: Path) -> None:
    dense_cfg = {"data": str(small_corpus), "n_layer": 2, "n_head": 2, "d_model": 32,
                 "block_size": 32, "batch_size": 8, "steps": 30, "lr": 3e-3, "warmup_steps": 0,
                 "min_lr_ratio": 1.0, "eval_every": 100, "eval_batches": 1, "log_every": 5,
                 "dtype": "fp32", "samples": 0}
    dense, up = tmp_path / "dense", tmp_path / "up"
    run_on_ranks(_train, 1, args=(dense_cfg, str(dense)), timeout=120)
    assert upcycle_main([str(dense), "--num-experts", "4", "--moe-every", "1",
                         "--set", "num_experts_per_tok=2", "--set", "drop_tokens=false",
                         "--run-dir", str(up)]) == 0
    assert upcycle_main([str(dense), "--num-experts", "4", "--run-dir", str(up)]) == 2  # taken
    assert upcycle_main([str(dense), "--num-experts", "4", "--set", "n_group=3",
                         "--run-dir", str(tmp_path / "bad")]) == 2
    with pytest.raises(ValueError, match="already holds an MoE"):
        upcycle(up, tmp_path / "again", 4)
    cfg = json.loads((up / "config.json").read_text())
    assert cfg["num_experts"] == 4 and cfg["moe_every"] == 1 and cfg["num_experts_per_tok"] == 2
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad(), dropless(m := load_model(up)):
        assert torch.allclose(m(x).logits, load_model(dense)(x).logits, atol=1e-5)
    # continue 10 more steps: the first MoE losses sit at the dense run's, far below ln 256
    run_on_ranks(_train, 1, args=({**cfg, "resume": True, "steps": 40}, str(up)), timeout=120)
    dense_last = _losses(dense)[-1][1]
    after = dict(_losses(up))
    assert set(after) == {5, 10, 15, 20, 25, 30, 35, 40}  # the dense curve, then the MoE one
    assert abs(after[35] - dense_last) < 0.3 and after[35] < 5.0
    shard = torch.load(up / "checkpoints/step-00000040/rank-00000.pt", weights_only=True)
    assert "blocks.1.ffn.experts.w1" in shard["model"]
    start = json.loads((up / "metrics.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["n_expert_params"] > 0
    assert start["dense_n_params"] < start["n_params"]
