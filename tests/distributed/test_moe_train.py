"""MoE models in the real training loop: expert parallelism, exact resume, resharding."""

from pathlib import Path

import torch

from moebit.testing import run_on_ranks
from moebit.training.config import build


def moe_cfg(corpus: Path, **kw) -> dict:
    cfg = {"data": str(corpus), "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
           "batch_size": 4, "steps": 10, "lr": 3e-3, "warmup_steps": 0, "min_lr_ratio": 1.0,
           "eval_every": 100, "eval_batches": 1, "log_every": 5, "dtype": "fp32", "samples": 0,
           "num_experts": 4, "num_experts_per_tok": 2, "ep_size": 2}
    cfg.update(kw)
    return cfg


def _run(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def _outputs(rank: int, world: int, cfg_dict: dict, src: str, dst: str | None):
    """Load the newest checkpoint of ``src`` on this world/ep size, return logits on a
    fixed batch (and save the resharded model to ``dst``)."""
    from moebit.checkpoint import latest, read_manifest
    from moebit.comm.collectives import init_from_env
    from moebit.models.gpt import GPT
    from moebit.training.state import load_model_weights

    cfg = build(cfg_dict)
    model = GPT(cfg.model_config())
    d = latest(src)
    load_model_weights(d, read_manifest(d), model, rank, cfg.moe.ep_size)
    model.eval()
    x = torch.arange(2 * 32).reshape(2, 32) % 256
    with torch.no_grad():
        logits = model(x).logits
    if dst is not None:
        from moebit.training.data import TrainBatches, load_corpus
        from moebit.training.setup import make_optimizer, param_groups
        from moebit.training.state import save

        info = init_from_env("cpu")
        opt = make_optimizer(cfg, param_groups(model, cfg))
        batches = TrainBatches(load_corpus(cfg.data).train, 32, 4, 0, rank)
        save(Path(dst), 10, model, opt, batches, info, cfg, wall=0.0, train_time=0.0)
    return logits


def test_ep2_training_keeps_dense_replicas_identical(small_corpus: Path, tmp_path: Path):
    s0, s1 = run_on_ranks(_run, 2, args=(moe_cfg(small_corpus), str(tmp_path)), timeout=120)
    # Each rank evaluates its own copy of the batch; expert GEMMs see the two ranks' rows in
    # different batch shapes, so the losses agree to rounding, not bit for bit.
    assert abs(s0["val_loss"] - s1["val_loss"]) < 1e-4
    assert s0["val_loss"] < 5.0
    d = tmp_path / "checkpoints" / "step-00000010"
    shards = [torch.load(d / f"rank-0000{r}.pt", weights_only=True)["model"] for r in range(2)]
    experts = [k for k in shards[0] if ".experts." in k]
    assert experts, "no expert parameters in the checkpoint"
    for k, t in shards[0].items():
        if k in experts:
            assert not torch.equal(t, shards[1][k]), f"{k}: ranks should hold different experts"
        else:
            assert torch.equal(t, shards[1][k]), f"{k}: dense replicas diverged"


def test_moe_resume_is_bit_exact(small_corpus: Path, tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_on_ranks(_run, 2, args=(moe_cfg(small_corpus), str(a)), timeout=120)
    run_on_ranks(_run, 2, args=(moe_cfg(small_corpus, steps=5), str(b)), timeout=120)
    run_on_ranks(_run, 2, args=(moe_cfg(small_corpus, resume=True), str(b)), timeout=120)
    for r in range(2):
        sa = torch.load(a / "checkpoints/step-00000010" / f"rank-0000{r}.pt", weights_only=True)
        sb = torch.load(b / "checkpoints/step-00000010" / f"rank-0000{r}.pt", weights_only=True)
        for k in sa["model"]:
            assert torch.equal(sa["model"][k], sb["model"][k]), k


def test_reshard_ep2_to_ep4_to_ep2_keeps_outputs(small_corpus: Path, tmp_path: Path):
    run = tmp_path / "run"
    run_on_ranks(_run, 2, args=(moe_cfg(small_corpus), str(run)), timeout=120)
    two = run_on_ranks(_outputs, 2, args=(moe_cfg(small_corpus), str(run), None), timeout=120)
    four = run_on_ranks(_outputs, 4, args=(moe_cfg(small_corpus, ep_size=4), str(run),
                                           str(tmp_path / "four")), timeout=180)
    back = run_on_ranks(_outputs, 2, args=(moe_cfg(small_corpus), str(tmp_path / "four"), None),
                        timeout=120)
    for got in (*four, *back, two[1]):
        torch.testing.assert_close(got, two[0], rtol=1e-5, atol=1e-5)
