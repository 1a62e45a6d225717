"""Real multi-rank training: gloo ranks, real text, loss falls, replicas stay identical."""

import json
from pathlib import Path

import pytest
import torch

from moebit.testing import free_port, run_on_ranks
from moebit.training.config import build

from launches import run_two_nodes


def _train_body(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    cfg = build(cfg_dict)
    return train(cfg, Path(run_dir), init_from_env("cpu"))


def _params_body(rank: int, world: int, cfg_dict: dict):
    """Train a few steps and return the flat parameters of this rank."""
    import torch.distributed as dist

    from moebit.comm.collectives import broadcast_params_
    from moebit.models.gpt import GPT
    from moebit.training.data import TrainBatches, load_corpus
    from moebit.training.grads import average_gradients, clip_gradients
    from moebit.training.setup import make_optimizer, param_groups

    cfg = build(cfg_dict)
    torch.manual_seed(rank)  # different init per rank: broadcast must fix it
    model = GPT(cfg.model_config())
    broadcast_params_(model)
    opt = make_optimizer(cfg, param_groups(model, cfg))
    corpus = load_corpus(cfg.data)
    batches = TrainBatches(corpus.train, cfg.model.block_size, cfg.batch_size, cfg.seed, rank)
    losses = []
    for _ in range(cfg.steps):
        x, y = batches.next()
        loss = model(x, y).loss
        opt.zero_grad()
        loss.backward()
        average_gradients(opt)
        clip_gradients(model, 1.0)
        opt.step()
        losses.append(float(loss))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert dist.get_world_size() == world
    return flat, losses


def tiny_cfg(corpus: Path, **kw) -> dict:
    cfg = {"data": str(corpus), "n_layer": 2, "n_head": 2, "d_model": 64, "block_size": 32,
           "batch_size": 8, "steps": 40, "lr": 3e-3, "warmup_steps": 5, "eval_every": 20,
           "eval_batches": 2, "log_every": 10, "dtype": "fp32", "samples": 0}
    cfg.update(kw)
    return cfg


def test_two_ranks_loss_falls_and_params_identical(small_corpus: Path):
    (p0, l0), (p1, l1) = run_on_ranks(_params_body, 2, args=(tiny_cfg(small_corpus),), timeout=120)
    assert torch.equal(p0, p1), "replicas diverged"
    assert l0 != l1, "ranks saw the same batches"
    first, last = sum(l0[:5]) / 5, sum(l0[-5:]) / 5
    assert last < first - 0.5, (first, last)


def test_training_loop_writes_metrics_checkpoint_and_plots(small_corpus: Path, tmp_path: Path):
    s0, s1 = run_on_ranks(_train_body, 2, args=(tiny_cfg(small_corpus), str(tmp_path)), timeout=180)
    assert s0["val_loss"] == s1["val_loss"]  # same params, same validation batches
    assert s0["val_loss"] < s0["unigram_entropy"] + 0.6
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in recs}
    assert {"start", "train", "eval", "end"} <= kinds
    train = [r for r in recs if r["kind"] == "train"]
    assert all(r["bytes_sent"] > 0 and r["tokens_per_s"] > 0 for r in train)
    n_params = recs[0]["n_params"]
    # Each step moves the fp32 gradients through a ring allreduce: 2·(W-1)/W·4·n = 4n bytes.
    assert train[-1]["step_bytes_sent"] == pytest.approx(4 * n_params, rel=0.01)
    ckpt = tmp_path / "checkpoints" / "step-00000040"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 40
    shards = [torch.load(ckpt / f"rank-0000{r}.pt", weights_only=True) for r in range(2)]
    for name, t in shards[0]["model"].items():
        assert torch.equal(t, shards[1]["model"][name]), name
    assert (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.slow
def test_cli_two_nodes_train_together(tmp_path: Path, small_corpus: Path):
    """The multi-node path: two torchrun launchers (one rank each) meet at a c10d rendezvous."""
    port = free_port()
    run_dir = tmp_path / "run"
    common = ["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"test{port}", "--data", str(small_corpus), "--n-layer", "1",
              "--n-head", "2", "--d-model", "32", "--block-size", "32", "--batch-size", "4",
              "--steps", "10", "--eval-every", "10", "--eval-batches", "1", "--samples", "0",
              "--dtype", "fp32"]
    run_two_nodes(common, run_dir, port, timeout=150)
    metrics = [run_dir / f"node{i}" / "metrics.jsonl" for i in range(2)]
    written = [m for m in metrics if m.exists()]
    assert len(written) == 1, "exactly the global rank 0 writes metrics"
    end = json.loads(written[0].read_text().splitlines()[-1])
    start = json.loads(written[0].read_text().splitlines()[0])
    assert start["world_size"] == 2 and end["bytes_sent"] > 0


def test_onebit_warmup_in_the_loop_equals_adam_clipping_included(small_corpus: Path, tmp_path: Path):
    """In warm-up the loop averages and clips the average, so 1-bit Adam's run is Adam's.

    The clip threshold is low enough to act on every step: clipping each rank's local
    gradient instead (what the loop did before) would give a different run.
    """
    common = {"steps": 8, "eval_every": 8, "grad_clip": 0.05, "weight_decay": 0.0}
    adam = run_on_ranks(_train_body, 2, args=(tiny_cfg(small_corpus, optimizer="adam", **common),
                                              str(tmp_path / "adam")), timeout=180)
    onebit = run_on_ranks(_train_body, 2, args=(tiny_cfg(small_corpus, optimizer="onebit_adam",
                                                          freeze_step=100, **common),
                                                str(tmp_path / "onebit")), timeout=180)
    assert adam[0]["val_loss"] == onebit[0]["val_loss"] == onebit[1]["val_loss"]
    recs = [json.loads(x) for x in (tmp_path / "onebit" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert train and all(r["clipped_frac"] == 1.0 for r in train), train


def test_freeze_is_recorded_with_the_warm_up_clip_rate(small_corpus: Path, tmp_path: Path):
    cfg = tiny_cfg(small_corpus, optimizer="onebit_adam", freeze_step=4, steps=8, eval_every=8,
                   grad_clip=0.05)
    s0, s1 = run_on_ranks(_train_body, 2, args=(cfg, str(tmp_path)), timeout=180)
    assert s0["val_loss"] == s1["val_loss"] and s0["frozen_at"] == 4
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (freeze,) = [r for r in recs if r["kind"] == "freeze"]
    assert freeze["step"] == 4 and freeze["clipped_frac_before"] == 1.0
