"""Checkpoints: bit-exact resume, atomic commit, corruption detection, NaN handling."""

import json
from pathlib import Path

import pytest
import torch

from moebit.checkpoint import latest
from moebit.config import build
from moebit.testing import RankFailed, run_on_ranks


def _run(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.distributed import init_from_env
    from moebit.train import _train

    return _train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


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


def test_keep_last_k_and_manifest_commit(small_corpus: Path, tmp_path: Path):
    run_on_ranks(_run, 2, args=(cfg_for(small_corpus, save_every=3, keep_checkpoints=2),
                                str(tmp_path)), timeout=120)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-00000009", "step-00000012"]
    # A folder without a manifest (a save interrupted before its commit) is ignored.
    (tmp_path / "checkpoints" / "step-00000015").mkdir()
    assert latest(tmp_path).name == "step-00000012"


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_shard_is_named(small_corpus: Path, tmp_path: Path, damage: str):
    run_on_ranks(_run, 2, args=(cfg_for(small_corpus, steps=4), str(tmp_path)), timeout=120)
    shard = latest(tmp_path) / "rank-00001.pt"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    with pytest.raises(RankFailed, match="rank-00001.pt is (truncated|corrupted)"):
        run_on_ranks(_run, 2, args=(cfg_for(small_corpus, steps=8, resume=True),
                                    str(tmp_path)), timeout=120)


def test_resume_without_checkpoint_is_an_error(small_corpus: Path, tmp_path: Path):
    with pytest.raises(RankFailed, match="no complete checkpoint"):
        run_on_ranks(_run, 1, args=(cfg_for(small_corpus, resume=True), str(tmp_path)),
                     timeout=60)


def test_resume_into_another_model_is_an_error(small_corpus: Path, tmp_path: Path):
    run_on_ranks(_run, 1, args=(cfg_for(small_corpus, steps=2), str(tmp_path)), timeout=60)
    with pytest.raises(RankFailed, match="another model.*d_model"):
        run_on_ranks(_run, 1, args=(cfg_for(small_corpus, steps=4, d_model=64, resume=True),
                                    str(tmp_path)), timeout=60)


def test_reshard_dense_two_ranks_to_one(small_corpus: Path, tmp_path: Path):
    run_on_ranks(_run, 2, args=(cfg_for(small_corpus, steps=4), str(tmp_path)), timeout=120)
    before = final_params(tmp_path, 1)[0]
    run_on_ranks(_run, 1, args=(cfg_for(small_corpus, steps=4, resume=True), str(tmp_path)),
                 timeout=60)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "resume" and r["resharded"] for r in recs)
    after = final_params(tmp_path, 1)[0]
    _assert_same([before], [after])  # nothing left to train: the weights carried over


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
    from moebit.distributed import init_from_env
    from moebit.models import gpt
    from moebit.train import _train

    original = gpt.GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, caches=None):
        out = original(self, idx, targets, caches)
        if self.training and targets is not None:
            calls["n"] += 1
            if rank == 1 and calls["n"] == 3:
                out.loss = out.loss * float("nan")
        return out

    gpt.GPT.forward = poisoned
    summary = _train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))
    if policy == "skip":
        # NaN never entered the optimizer state.
        pass
    return summary
