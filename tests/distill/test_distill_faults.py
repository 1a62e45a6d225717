"""A rank killed mid-distillation: with --max-restarts the ranks restart, resume from the
newest checkpoint in the KD stage they were in, and finish."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from moebit.testing import run_on_ranks
from moebit.training.config import build


def _train_teacher(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def distill_rank_pids(tag: str) -> dict[int, int]:
    """{global rank: pid} of the distillation ranks started with MOEBIT_TEST_TAG=tag."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"moebit.distill.run" not in cmd:
            continue
        vars_ = dict(e.split(b"=", 1) for e in env if b"=" in e)
        if vars_.get(b"MOEBIT_TEST_TAG") == tag.encode() and b"RANK" in vars_:
            found[int(vars_[b"RANK"])] = int(entry)
    return found


@pytest.mark.slow
def test_max_restarts_resumes_a_distillation_in_its_kd_stage(tmp_path: Path, small_corpus: Path):
    teacher = tmp_path / "teacher"
    t_cfg = {"data": str(small_corpus), "n_layer": 2, "n_head": 2, "d_model": 32,
             "block_size": 32, "batch_size": 4, "steps": 4, "eval_every": 100,
             "eval_batches": 1, "dtype": "fp32", "samples": 0, "warmup_steps": 0}
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(build(t_cfg).to_dict()))
    run_on_ranks(_train_teacher, 1, args=(t_cfg, str(teacher)), timeout=120)
    run, tag = tmp_path / "student", uuid.uuid4().hex
    args = [sys.executable, "-m", "moebit.cli", "distill", "--teacher", str(teacher),
            "--student-layers", "1", "--nproc", "2", "--steps", "300", "--save-every", "20",
            "--kd-stop", "fraction", "--kd-stop-fraction", "0.5", "--log-every", "5",
            "--eval-every", "300", "--threads", "1", "--max-restarts", "1",
            "--run-dir", str(run)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", MOEBIT_TEST_TAG=tag),
                            start_new_session=True)
    try:
        deadline, killed = time.monotonic() + 120, False
        while time.monotonic() < deadline and not killed:
            if proc.poll() is not None:
                raise AssertionError("run ended before the fault: " + proc.stdout.read()[-2000:])
            if list((run / "checkpoints").glob("step-*/manifest.json")):
                pid = distill_rank_pids(tag).get(1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            time.sleep(0.05)
        assert killed, "no checkpoint appeared within 120 s"
        out = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
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
