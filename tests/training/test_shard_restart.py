"""``--max-restarts`` under ``--shard fsdp``: a rank killed after the first DCP
checkpoint, torchrun restarts the ranks, they load the checkpoint and the run finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


def _rank_pid(tag: str, rank: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found = dict(e.split(b"=", 1) for e in env if b"=" in e)
        if (b"moebit.training.loop" in cmd and found.get(b"MOEBIT_TEST_TAG") == tag.encode()
                and found.get(b"RANK") == str(rank).encode()):
            return int(entry)
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_max_restarts_resumes_a_sharded_run_from_its_dcp_checkpoint(tmp_path: Path,
                                                                    small_corpus: Path) -> None:
    run, tag = tmp_path / "run", uuid.uuid4().hex
    args = [sys.executable, "-m", "moebit.cli", "train", "--nproc", "2", "--data",
            str(small_corpus), "--n-layer", "1", "--n-head", "2", "--d-model", "32",
            "--block-size", "32", "--batch-size", "4", "--steps", "200", "--save-every", "10",
            "--eval-every", "200", "--eval-batches", "1", "--samples", "0", "--dtype", "fp32",
            "--log-every", "5", "--max-restarts", "1", "--run-dir", str(run), "--shard", "fsdp",
            "--rs-compress", "int8"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", MOEBIT_TEST_TAG=tag),
                            start_new_session=True)
    try:
        deadline, killed = time.monotonic() + 300, False
        while time.monotonic() < deadline and not killed and proc.poll() is None:
            if list((run / "checkpoints").glob("step-*/manifest.json")):
                pid = _rank_pid(tag, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            time.sleep(0.05)
        assert killed, "no checkpoint, or the run ended before the fault"
        out = proc.communicate(timeout=400)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    resumes = [r for r in recs if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] % 10 == 0 and not resumes[0]["resharded"]
    assert recs[-1]["kind"] == "end" and recs[-1]["steps"] == 200 and recs[-1]["shard"] == "fsdp"
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "no step logged twice"
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert json.loads((newest / "manifest.json").read_text())["kind"] == "dcp"
