"""Distillation on 2 gloo ranks with expert parallelism (ep 2), and the CLI end to end."""

import json
from pathlib import Path

import pytest
import torch

from moebit.config import build
from moebit.distill import DISTILL_FILE, DistillConfig, DistillError, student_train_config
from moebit.testing import run_on_ranks


def teacher_cfg(corpus: Path) -> dict:
    return {"data": str(corpus), "n_layer": 4, "n_head": 2, "d_model": 32, "block_size": 32,
            "batch_size": 4, "steps": 12, "lr": 3e-3, "warmup_steps": 0, "min_lr_ratio": 1.0,
            "eval_every": 100, "eval_batches": 2, "log_every": 4, "dtype": "fp32", "samples": 0,
            "num_experts": [2, 4], "moe_residual": True, "ep_size": 2}


def _train(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.distributed import init_from_env
    from moebit.train import _train

    return _train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def _distill(rank: int, world: int, jobs: list):
    """Several distillations in one spawn (each: config dict, distill dict, run folder)."""
    from moebit.distill import distill
    from moebit.distributed import init_from_env

    out = []
    for cfg_dict, d_dict, run_dir in jobs:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        out.append(distill(build(cfg_dict), DistillConfig.from_dict(d_dict), Path(run_dir),
                           init_from_env("cpu")))
    return out


@pytest.fixture(scope="module")
def teacher_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("teacher")
    (run / "config.json").write_text(json.dumps(build(teacher_cfg(small_corpus)).to_dict()))
    run_on_ranks(_train, 2, args=(teacher_cfg(small_corpus), str(run)), timeout=120)
    return run


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ep2_distillation_stage_switch_and_sharded_init(teacher_run: Path, tmp_path: Path):
    t_cfg = build(json.loads((teacher_run / "config.json").read_text()))
    # (a) a student as deep as the teacher, fp32 everywhere: its init must reproduce the
    #     teacher's validation loss, so every rank received its own experts' weights.
    full = DistillConfig(teacher=str(teacher_run), student_layers=4, teacher_dtype="fp32")
    cfg_a, _ = student_train_config(t_cfg, full, {"steps": 1})
    # (b) the real thing: 2 of 4 blocks, KD for 40% of 10 steps, logged every step.
    d = DistillConfig(teacher=str(teacher_run), student_layers=2, kd_stop_fraction=0.4,
                      kd_weight=1.0, temperature=2.0)
    cfg_b, keep = student_train_config(t_cfg, d, {"steps": 10, "log_every": 1, "eval_every": 5})
    d.keep_layers = keep
    jobs = [(cfg_a.to_dict(), full.to_dict(), str(tmp_path / "a")),
            (cfg_b.to_dict(), d.to_dict(), str(tmp_path / "b"))]
    res = run_on_ranks(_distill, 2, args=(jobs,), timeout=150)
    (a0, b0), (a1, b1) = res
    start_a = _records(tmp_path / "a")[0]
    assert start_a["init_val_loss"] == pytest.approx(start_a["teacher_val_loss"], abs=1e-5)

    recs = _records(tmp_path / "b")
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "start" and kinds[-1] == "end" and "eval" in kinds
    start = recs[0]
    assert start["keep_layers"] == [0, 3] and start["kd_steps"] == 4
    assert start["teacher_params"] > start["n_params"]
    stops = [r for r in recs if r["kind"] == "kd_stop"]
    assert len(stops) == 1 and stops[0]["step"] == 4
    trains = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in trains if "kd_loss" in r] == [1, 2, 3, 4]
    assert all(r["kd_loss"] > 0 for r in trains if "kd_loss" in r)
    assert recs.index(stops[0]) > kinds.index("train") + 3  # logged after step 4's record
    assert b0["val_loss"] == pytest.approx(b1["val_loss"], abs=1e-4)
    assert b0["kd_steps"] == 4 and a0["steps"] == 1 and a1["steps"] == 1
    # the checkpoint is an ordinary ep-2 student run: ranks hold different experts
    ck = tmp_path / "b" / "checkpoints" / "step-00000010"
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["model_config"]["n_layer"] == 2 and manifest["model_config"]["num_experts"] == [4]
    s0, s1 = (torch.load(ck / f"rank-0000{r}.pt", weights_only=True)["model"] for r in range(2))
    experts = [k for k in s0 if ".experts." in k]
    assert experts and all(not torch.equal(s0[k], s1[k]) for k in experts)
    assert all(torch.equal(s0[k], s1[k]) for k in s0 if k not in experts)


def test_cli_launches_ranks_and_refuses_bad_students(teacher_run: Path, tmp_path: Path):
    from moebit.cli import UsageError
    from moebit.distill_cli import main, parse_args
    from moebit.report import report

    base = ["--teacher", str(teacher_run), "--student-layers", "2"]
    with pytest.raises(UsageError, match="--d-model cannot be set"):
        parse_args(base + ["--d-model", "64"])
    with pytest.raises(DistillError, match="student block 1 is an MoE block"):
        parse_args(base + ["--keep-layers", "0,2"])
    with pytest.raises(DistillError, match="not a run folder"):
        parse_args(["--teacher", str(tmp_path), "--student-layers", "2"])
    run = tmp_path / "nokd"
    assert main(base + ["--no-kd", "--steps", "3", "--nproc", "2", "--threads", "1",
                        "--run-dir", str(run)]) == 0
    assert json.loads((run / DISTILL_FILE).read_text())["no_kd"] is True
    recs = _records(run)
    assert any(r["kind"] == "kd_stop" and r["step"] == 0 for r in recs)
    assert not any("kd_loss" in r for r in recs if r["kind"] == "train")
    assert (run / "loss.png").is_file()
    table, _ = report([str(teacher_run), str(run)], str(tmp_path))
    assert "nokd" in table and "teacher" in table
