"""Faults in real `moebit train` runs: a rank killed mid-run stops the run quickly with a
clear error, or, with --max-restarts, the ranks restart from the last checkpoint and finish."""

import time
from pathlib import Path

import pytest

from launches import Launch, kill_rank_after_first_checkpoint, restart_after_a_kill, restart_args
from launches import start as start_cli


def start(tmp_path: Path, corpus: Path, max_restarts: int) -> Launch:
    run = tmp_path / "run"
    return start_cli("train", restart_args(corpus, run, 400, 20, max_restarts), run)


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
    recs = restart_after_a_kill(start(tmp_path, small_corpus, max_restarts=1), timeout=240)
    resumes = [r for r in recs if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] % 20 == 0
    assert recs[-1]["kind"] == "end" and recs[-1]["steps"] == 400
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "no step logged twice"
