"""A rank killed mid-distillation: with --max-restarts the ranks restart, resume from the
newest checkpoint in the KD stage they were in, and finish."""

import json
from pathlib import Path

import pytest

from moebit.testing import run_on_ranks
from moebit.training.config import build

from launches import DISTILL_MODULE, restart_after_a_kill, start


def _train_teacher(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


@pytest.mark.slow
def test_max_restarts_resumes_a_distillation_in_its_kd_stage(tmp_path: Path, small_corpus: Path):
    teacher = tmp_path / "teacher"
    t_cfg = {"data": str(small_corpus), "n_layer": 2, "n_head": 2, "d_model": 32,
             "block_size": 32, "batch_size": 4, "steps": 4, "eval_every": 100,
             "eval_batches": 1, "dtype": "fp32", "samples": 0, "warmup_steps": 0}
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(build(t_cfg).to_dict()))
    run_on_ranks(_train_teacher, 1, args=(t_cfg, str(teacher)), timeout=120)
    run = tmp_path / "student"
    args = ["--teacher", str(teacher), "--student-layers", "1", "--nproc", "2", "--steps", "300",
            "--save-every", "20", "--kd-stop", "fraction", "--kd-stop-fraction", "0.5",
            "--log-every", "5", "--eval-every", "300", "--threads", "1", "--max-restarts", "1",
            "--run-dir", str(run)]
    recs = restart_after_a_kill(start("distill", args, run, DISTILL_MODULE), timeout=240)
    resumes = [r for r in recs if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] % 20 == 0 and resumes[0]["step"] < 300
    assert [r["kind"] for r in recs].count("start") == 1
    stops = [r for r in recs if r["kind"] == "kd_stop"]
    assert [(s["step"], s["rule"]) for s in stops] == [(150, "fraction")], stops
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "no step logged twice"
    assert max(r["step"] for r in recs if r["kind"] == "train" and "kd_loss" in r) == 150
    end = recs[-1]
    assert end["kind"] == "end" and end["steps"] == 300
    assert end["kd_steps"] == 150  # the KD steps of both attempts
