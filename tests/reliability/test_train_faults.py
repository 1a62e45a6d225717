"""Issue 21 items 1, 4, 5 and 7 with real `moebit train` runs (2 gloo ranks, tiny model)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moebit.runs import lock as runlock

from launches import children, wait_for_checkpoint

TINY = ["--nproc", "2", "--n-layer", "1", "--n-head", "2", "--block-size", "32",
        "--batch-size", "4", "--samples", "0", "--dtype", "fp32", "--eval-batches", "1",
        "--threads", "1", "--log-every", "1"]


def train(args: list[str], **kw: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moebit.cli", "train", *TINY, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            **kw)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_second_run_is_refused_and_ranks_die_with_a_killed_launcher(tmp_path: Path,
                                                                     small_corpus: Path):
    run = tmp_path / "run"
    a = train(["--data", str(small_corpus), "--d-model", "64", "--steps", "100000",
               "--save-every", "5", "--run-dir", str(run)])
    try:
        wait_for_checkpoint(a, run)
        b = subprocess.run([sys.executable, "-m", "moebit.cli", "train", *TINY, "--data",
                            str(small_corpus), "--d-model", "32", "--steps", "5", "--run-dir", str(run)],
                           capture_output=True, text=True, timeout=120)
        assert b.returncode == 2, b.stderr
        lines = b.stderr.strip().splitlines()
        assert len(lines) == 2 and "data:" in lines[0], b.stderr  # the data line, then the refusal
        assert f"is in use by moebit train (pid {a.pid}" in lines[1]
        assert json.loads((run / "config.json").read_text())["d_model"] == 64, "A's config intact"
        ranks = children(a.pid)
        assert len(ranks) == 2
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if alive(p)], "ranks outlived their launcher by 10 s"
        runlock.acquire(run, "test").release()  # and the folder is free for a resume at once
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        for p in children(a.pid):
            os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_sigint_prints_the_stop_line_and_exits_130(tmp_path: Path, small_corpus: Path):
    run = tmp_path / "run"
    proc = train(["--data", str(small_corpus), "--d-model", "32", "--steps", "100000",
                  "--save-every", "3", "--run-dir", str(run)])
    try:
        wait_for_checkpoint(proc, run)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"moebit train: training stopped at step \d+; last checkpoint step \d+; "
                        rf"resume with: moebit train --resume {re.escape(str(run))}", last), last


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_many_short_runs_all_exit_0(tmp_path: Path, small_corpus: Path):
    """Item 5: finished runs used to abort at exit now and then ("terminate called without
    an active exception"), about 1 in 10. 3 runs at once (a race at teardown is no less
    likely with neighbours; 6 ranks exit); MOEBIT_TEST_SHORT_RUNS overrides the count (30
    were run once, all exit 0)."""
    n = int(os.environ.get("MOEBIT_TEST_SHORT_RUNS", "3"))
    for wave in range(0, n, 3):
        procs = {i: train(["--data", str(small_corpus), "--d-model", "32", "--steps", "2",
                           "--threads", "1", "--run-dir", str(tmp_path / f"r{i}")])
                 for i in range(wave, min(n, wave + 3))}
        for i, proc in procs.items():
            out = proc.communicate(timeout=300)[0]
            assert proc.returncode == 0, f"run {i}: " + out[-3000:]
            assert "terminate called" not in out and (tmp_path / f"r{i}" / "loss.png").is_file()


def test_running_ranks_in_process_gives_the_callers_signal_handlers_back(tmp_path: Path,
                                                                        small_corpus: Path):
    """torchrun's agent installs its own SIGINT/SIGTERM handlers and never restores them: a
    caller running ``moebit train`` in-process (a test, a notebook) kept them, so its own
    Ctrl-C became torchrun's SignalException."""
    import signal

    from moebit.cli import main as moebit

    mine = {sig: (lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    before = {sig: signal.signal(sig, h) for sig, h in mine.items()}
    try:
        assert moebit(["train", "--data", str(small_corpus), "--d-model", "32", "--n-layer", "1",
                       "--steps", "1", "--nproc", "1", "--threads", "1", "--samples", "0",
                       "--run-dir", str(tmp_path / "run")]) == 0
        assert {sig: signal.getsignal(sig) for sig in mine} == mine
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
