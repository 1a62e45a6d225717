"""Checkpoints: bit-exact resume, atomic commit, corruption detection, NaN handling."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from moebit.checkpoint import CheckpointError, latest
from moebit.testing import RankFailed, run_on_ranks
from moebit.training.config import build


def _run(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def cfg_for(corpus: Path, **kw) -> dict:
    # Constant learning rate: the schedule must not depend on the total step count, so
    # that "N steps, then resume to 2N" and "2N straight" take identical steps.
    cfg = {"data": str(corpus), "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
           "batch_size": 4, "steps": 12, "lr": 2e-3, "warmup_steps": 0, "min_lr_ratio": 1.0,
           "eval_every": 100, "eval_batches": 1, "log_every": 4, "dtype": "fp32",
           "samples": 0, "dropout": 0.1}
    cfg.update(kw)
    return cfg


def final_params(run_dir: Path, world: int) -> list[dict[str, torch.Tensor]]:
    d = latest(run_dir)
    return [torch.load(d / f"rank-{r:05d}.pt", weights_only=True)["model"] for r in range(world)]


def _assert_same(a: list[dict], b: list[dict]) -> None:
    for sa, sb in zip(a, b, strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("optimizer", ["adam", "onebit_adam"])
def test_resume_is_bit_exact(small_corpus: Path, tmp_path: Path, optimizer: str):
    extra = {"optimizer": optimizer, "freeze_step": 4} if optimizer != "adam" else {}
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_on_ranks(_run, 2, args=(cfg_for(small_corpus, **extra), str(straight)), timeout=120)
    run_on_ranks(_run, 2, args=(cfg_for(small_corpus, steps=6, **extra), str(split)), timeout=120)
    run_on_ranks(_run, 2, args=(cfg_for(small_corpus, resume=True, **extra), str(split)),
                 timeout=120)
    _assert_same(final_params(straight, 2), final_params(split, 2))
    recs = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in recs].count("resume") == 1
    assert [r["step"] for r in recs if r["kind"] == "train"] == [4, 6, 8, 12]
    # The whole-run counters of the resumed run's end record cover both attempts.
    whole = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    end = recs[-1]
    assert end["kind"] == whole["kind"] == "end" and whole["bytes_sent"] > 0
    for key in ("bytes_sent", "bytes_recv", "collectives", "nan_skipped"):
        assert end[key] == whole[key], key
    assert [r["bytes_sent"] for r in recs if r["kind"] == "train"][-1] == end["bytes_sent"]


@pytest.fixture(scope="module")
def saved_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-rank run with checkpoints every 3 steps (the last 2 kept)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    run_on_ranks(_run, 2, args=(cfg_for(small_corpus, save_every=3, keep_checkpoints=2),
                                str(run)), timeout=120)
    return run


def test_keep_last_k_and_manifest_commit(saved_run: Path):
    kept = sorted(p.name for p in (saved_run / "checkpoints").iterdir())
    assert kept == ["step-00000009", "step-00000012"]
    manifest = json.loads((saved_run / "checkpoints/step-00000012/manifest.json").read_text())
    assert set(manifest["files"]) == {"rank-00000.pt", "rank-00001.pt"}
    assert manifest["world_size"] == 2 and manifest["step"] == 12


def test_folder_without_manifest_is_ignored(saved_run: Path, tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    # A save interrupted before its commit: shard files but no manifest.
    partial = run / "checkpoints" / "step-00000015"
    partial.mkdir()
    shutil.copy(run / "checkpoints/step-00000012/rank-00000.pt", partial)
    assert latest(run).name == "step-00000012"


def _restore_in_process(run: Path, cfg: dict, rank: int, world: int):
    """Restore into fresh objects as rank ``rank`` would (same-size resume: no collectives)."""
    from moebit.comm.collectives import DistInfo
    from moebit.models.gpt import GPT
    from moebit.training.data import TrainBatches, load_corpus
    from moebit.training.setup import make_optimizer, param_groups
    from moebit.training.state import restore

    c = build(cfg)
    model = GPT(c.model_config())
    opt = make_optimizer(c, param_groups(model, c))
    batches = TrainBatches(load_corpus(c.data).train, c.model.block_size, c.batch_size, c.seed, rank)
    info = DistInfo(rank, world, rank, torch.device("cpu"), None)
    return restore(run, model, opt, batches, info, c)


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_shard_is_named(saved_run: Path, small_corpus: Path, tmp_path: Path, damage: str):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    shard = latest(run) / "rank-00001.pt"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    cfg = cfg_for(small_corpus, resume=True)
    assert _restore_in_process(run, cfg, 0, 2).step == 12  # rank 0's own shard is fine
    with pytest.raises(CheckpointError, match="rank-00001.pt is (truncated|corrupted)"):
        _restore_in_process(run, cfg, 1, 2)


def test_resume_without_checkpoint_is_an_error(small_corpus: Path, tmp_path: Path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        _restore_in_process(tmp_path, cfg_for(small_corpus, resume=True), 0, 1)


def test_resume_into_another_model_is_an_error(saved_run: Path, small_corpus: Path):
    with pytest.raises(CheckpointError, match="another model.*d_model"):
        _restore_in_process(saved_run, cfg_for(small_corpus, d_model=64, resume=True), 0, 2)


def test_reshard_dense_two_ranks_to_one(saved_run: Path, small_corpus: Path, tmp_path: Path):
    """2 ranks -> 1: the weights and Adam's moments carry over, and training continues."""
    from moebit.comm.collectives import DistInfo
    from moebit.models.gpt import GPT
    from moebit.training.data import TrainBatches, load_corpus
    from moebit.training.setup import make_optimizer, param_groups
    from moebit.training.state import restore

    c = build(cfg_for(small_corpus, resume=True))
    model = GPT(c.model_config())
    opt = make_optimizer(c, param_groups(model, c))
    batches = TrainBatches(load_corpus(c.data).train, c.model.block_size, c.batch_size, c.seed, 0)
    with pytest.warns(UserWarning, match="redistributed"):
        got = restore(saved_run, model, opt, batches, DistInfo(0, 1, 0, torch.device("cpu"), None), c)
    assert got.resharded and got.step == 12
    saved = torch.load(latest(saved_run) / "rank-00000.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved["model"][k]), k
    first = next(iter(model.parameters()))
    assert torch.equal(opt.state[first]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])

    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    run_on_ranks(_run, 1, args=(cfg_for(small_corpus, steps=14, resume=True), str(run)),
                 timeout=60)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "resume" and r["resharded"] for r in recs)
    assert recs[-1]["kind"] == "end" and latest(run).name == "step-00000014"


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_nan_loss_is_skipped_or_stops(small_corpus: Path, tmp_path: Path, policy: str,
                                      monkeypatch: pytest.MonkeyPatch):
    args = (cfg_for(small_corpus, steps=6, on_nan=policy), str(tmp_path), policy)
    if policy == "stop":
        with pytest.raises(RankFailed, match="non-finite loss .* step 3"):
            run_on_ranks(_run_with_nan, 2, args=args, timeout=120)
        return
    summaries = run_on_ranks(_run_with_nan, 2, args=args, timeout=120)
    assert summaries[0]["nan_skipped"] == 1
    for sd in final_params(tmp_path, 2):
        assert all(torch.isfinite(t).all() for t in sd.values())


def _run_with_nan(rank: int, world: int, cfg_dict: dict, run_dir: str, policy: str):
    """Rank 1 produces a NaN loss at step 3; every rank must take the same decision."""
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    from toys import poison_gpt_loss

    poison_gpt_loss(rank, on_rank=1, at_call=3)
    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))
