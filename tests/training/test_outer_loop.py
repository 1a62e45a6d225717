"""DiLoCo in the training loop: data-parallel equivalence, replicas at syncs, metrics.

The loop's real ``train()`` runs on 2 gloo ranks; with ``outer_group=world`` each rank is
its own DiLoCo worker, so the ranks drift apart between syncs and agree after each one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moebit.testing import run_on_ranks
from moebit.training.config import build


def _register_sgd() -> None:
    """Plain SGD as an inner optimizer (the registry's public extension point): DiLoCo
    with H=1, outer lr 1 and no momentum must then be data-parallel SGD."""
    from moebit.optim import register_optimizer

    register_optimizer("sgd", lambda groups, s, **extra: torch.optim.SGD(groups, lr=s.lr))


def _train(rank: int, world: int, cfg_dict: dict, run_dir: str) -> dict:
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    _register_sgd()
    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def cfg_for(corpus: Path, **kw) -> dict:
    cfg = {"data": str(corpus), "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
           "batch_size": 4, "steps": 8, "lr": 2e-3, "warmup_steps": 0, "min_lr_ratio": 1.0,
           "eval_every": 100, "eval_batches": 1, "log_every": 2, "dtype": "fp32",
           "samples": 0, "dropout": 0.0, "grad_clip": 0.0}
    cfg.update(kw)
    return cfg


def shard(run_dir: Path, step: int, rank: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}" / f"rank-{rank:05d}.pt",
                      weights_only=True)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_h1_lr1_no_momentum_equals_data_parallel_sgd(small_corpus: Path, tmp_path: Path):
    common = {"optimizer": "sgd", "lr": 0.05, "steps": 6}
    run_on_ranks(_train, 2, args=(cfg_for(small_corpus, **common), str(tmp_path / "dp")),
                 timeout=180)
    run_on_ranks(_train, 2, args=(cfg_for(small_corpus, **common, outer="diloco", outer_every=1,
                                          outer_lr=1.0, outer_momentum=0.0,
                                          outer_group="world"), str(tmp_path / "diloco")),
                 timeout=180)
    dp, dl = shard(tmp_path / "dp", 6, 0)["model"], shard(tmp_path / "diloco", 6, 0)["model"]
    start = shard(tmp_path / "dp", 6, 1)["model"]
    moved = 0.0
    for k, v in dp.items():
        assert torch.allclose(dl[k], v, rtol=0, atol=1e-6), (k, (dl[k] - v).abs().max())
        moved = max(moved, float((start[k] - v).abs().max()))
    # the runs trained (the SGD steps are large against the tolerance)
    first = records(tmp_path / "diloco")
    losses = [r["loss"] for r in first if r["kind"] == "train"]
    assert losses[-1] < losses[0], losses


@pytest.fixture(scope="module")
def diloco_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 workers (outer_group=world), H=4, 1-bit pseudo-gradients, a checkpoint every 2
    steps: 2 and 6 fall between syncs, 4 and 8 right after one (8 is also the end)."""
    run = tmp_path_factory.mktemp("diloco") / "run"
    cfg = cfg_for(small_corpus, outer="diloco", outer_every=4, outer_compress="1bit",
                  outer_group="world", save_every=2, keep_checkpoints=4)
    run_on_ranks(_train, 2, args=(cfg, str(run)), timeout=180)
    return run


def test_replicas_agree_after_each_sync_and_differ_between(diloco_run: Path):
    for step in (2, 4, 6, 8):
        a, b = shard(diloco_run, step, 0), shard(diloco_run, step, 1)
        same = all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
        assert same == (step % 4 == 0), step
        assert a["outer"]["state"]["outer"]["step"] == step
        assert a["outer"]["topology"] == {"outer_group": "world", "local_world_size": 2,
                                          "outer_ranks": [0, 1]}


def test_outer_metrics_records_and_bytes(diloco_run: Path):
    recs = records(diloco_run)
    assert recs[0]["kind"] == "start" and recs[0]["outer"] == "diloco"
    assert recs[0]["outer_workers"] == 2 and recs[0]["outer_fragments"] == 1
    outer = [r for r in recs if r["kind"] == "outer"]
    assert [r["step"] for r in outer] == [4, 8]
    for r in outer:
        assert r["outer_pseudo_grad_norm"] > 0 and r["outer_mean_pseudo_grad_norm"] > 0
        assert r["outer_seconds"] >= 0 and r["outer_bytes_sent"] > 0
    train = {r["step"]: r for r in recs if r["kind"] == "train"}
    assert train[4]["outer_syncs"] == 1 and "outer_syncs" not in train[2]
    assert train[4]["outer_pseudo_grad_norm"] == outer[0]["outer_pseudo_grad_norm"]
    # Between syncs nothing crosses to the other worker but the per-step NaN verdict.
    assert train[2]["step_bytes_by_kind"].get("outer", 0) == 0
    assert train[2]["step_bytes_by_kind"].get("exact", 0) == 0
    assert train[4]["step_bytes_by_kind"]["outer"] > 0
    end = recs[-1]
    assert end["kind"] == "end" and end["outer_syncs"] == 2  # the final agreement is not a scheduled sync
    assert end["bytes_sent_by_kind"]["outer"] > 0


def test_tensorboard_tags_of_an_outer_record(diloco_run: Path):
    from moebit.runs.tracking import tags_of

    rec = next(r for r in records(diloco_run) if r["kind"] == "outer")
    tags = tags_of(rec)
    assert tags.step == 4
    assert tags.scalars["outer/outer_pseudo_grad_norm"] == rec["outer_pseudo_grad_norm"]
    assert "outer/outer_seconds" in tags.scalars


def test_model_blocks_and_the_default_fragments():
    from moebit.models.gpt import GPT, GPTConfig
    from moebit.training.setup import model_blocks, outer_fragments

    model = GPT(GPTConfig(n_layer=3, n_head=2, d_model=32, block_size=32))
    blocks = model_blocks(model)
    assert len(blocks) == 5  # embeddings, 3 layers, final norm (+ head unless tied)
    ids = [id(p) for b in blocks for p in b]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sorted(ids) == sorted(id(p) for p in trainable) and len(ids) == len(set(ids))
    assert {id(p) for p in model.blocks[1].parameters()} == {id(p) for p in blocks[2]}
    assert id(model.wte.weight) in {id(p) for p in blocks[0]}
    model.wpe.weight.requires_grad_(False)  # frozen parameters are not synced
    assert id(model.wpe.weight) not in {id(p) for b in model_blocks(model) for p in b}

    def cfg(**kw):
        return build({"outer_every": 8, **kw})

    assert outer_fragments(cfg(outer="diloco"), 5) == 1
    assert outer_fragments(cfg(outer="streaming_diloco"), 5) == 5  # one per block
    assert outer_fragments(cfg(outer="streaming_diloco"), 12) == 8  # at most H
    assert outer_fragments(cfg(outer="streaming_diloco", outer_delay=3), 5) == 2  # D*F < H
    assert outer_fragments(cfg(outer="streaming_diloco", outer_fragments=3), 5) == 3


def _train_with_nan(rank: int, world: int, cfg_dict: dict, run_dir: str) -> dict:
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    from toys import poison_gpt_loss

    poison_gpt_loss(rank, on_rank=1, at_call=3)  # worker 1 alone skips its step 3
    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def test_a_step_one_worker_skips_keeps_the_sync_schedule(small_corpus: Path, tmp_path: Path):
    """Workers never agree on skips (no per-step round trip between them): the outer
    schedule counts loop steps, so their syncs meet at 4 and 8 and the run ends agreed."""
    cfg = cfg_for(small_corpus, outer="diloco", outer_every=4, outer_group="world")
    ends = run_on_ranks(_train_with_nan, 2, args=(cfg, str(tmp_path)), timeout=150)
    assert [e["nan_skipped"] for e in ends] == [0, 1]
    assert ends[0]["outer_syncs"] == ends[1]["outer_syncs"] == 2  # at steps 4 and 8
    a, b = (shard(tmp_path, 8, r)["model"] for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(r["kind"] != "nan" or r["step"] == 3 for r in records(tmp_path))
