"""Faults in real `moebit train` runs: a rank killed mid-run stops the run quickly with a
clear error, or, with --max-restarts, the ranks restart from the last checkpoint and finish."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Launch:
    proc: subprocess.Popen
    tag: str  # inherited by the ranks through their environment
    run: Path

    def rank_pids(self) -> dict[int, int]:
        """{global rank: pid} of this launch's training ranks, found through /proc."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"moebit.training.loop" not in cmd:
                continue
            vars_ = dict(e.split(b"=", 1) for e in env if b"=" in e)
            if vars_.get(b"MOEBIT_TEST_TAG") == self.tag.encode() and b"RANK" in vars_:
                found[int(vars_[b"RANK"])] = int(entry)
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def start(tmp_path: Path, corpus: Path, max_restarts: int) -> Launch:
    run = tmp_path / "run"
    tag = uuid.uuid4().hex
    args = [sys.executable, "-m", "moebit.cli", "train", "--nproc", "2", "--data", str(corpus),
            "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--block-size", "32",
            "--batch-size", "4", "--steps", "400", "--save-every", "20", "--eval-every", "400",
            "--eval-batches", "1", "--samples", "0", "--dtype", "fp32", "--log-every", "5",
            "--max-restarts", str(max_restarts), "--run-dir", str(run)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", MOEBIT_TEST_TAG=tag),
                            start_new_session=True)
    return Launch(proc, tag, run)


def kill_rank_after_first_checkpoint(launch: Launch, rank: int) -> float:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if launch.proc.poll() is not None:
            raise AssertionError("run ended before the fault: " + launch.proc.stdout.read()[-2000:])
        if list((launch.run / "checkpoints").glob("step-*/manifest.json")):
            pids = launch.rank_pids()
            if rank in pids:
                os.kill(pids[rank], signal.SIGKILL)
                return time.monotonic()
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared within 120 s")


@pytest.mark.slow
def test_killed_rank_stops_the_run_with_a_clear_error(tmp_path: Path, small_corpus: Path):
    launch = start(tmp_path, small_corpus, max_restarts=0)
    try:
        killed_at = kill_rank_after_first_checkpoint(launch, rank=1)
        out = launch.proc.communicate(timeout=90)[0]
        elapsed = time.monotonic() - killed_at
    finally:
        launch.stop()
    assert launch.proc.returncode != 0
    assert elapsed < 60, elapsed
    assert "training failed" in out and "rank 1" in out, out[-2000:]


@pytest.mark.slow
def test_max_restarts_resumes_from_the_last_checkpoint(tmp_path: Path, small_corpus: Path):
    launch = start(tmp_path, small_corpus, max_restarts=1)
    try:
        kill_rank_after_first_checkpoint(launch, rank=1)
        out = launch.proc.communicate(timeout=240)[0]
    finally:
        launch.stop()
    assert launch.proc.returncode == 0, out[-3000:]
    recs = [json.loads(x) for x in (launch.run / "metrics.jsonl").read_text().splitlines()]
    resumes = [r for r in recs if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] % 20 == 0
    assert recs[-1]["kind"] == "end" and recs[-1]["steps"] == 400
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "no step logged twice"
