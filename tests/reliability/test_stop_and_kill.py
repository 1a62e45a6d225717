"""A killed rank, restarts, and stop signals on every path.

- a rank killed with SIGKILL: one line per rank naming the dead one and the signal (the
  broken connections of its peers are echoes), RUN/attempts/N/errors.txt, "Resume with"
  (a kill is not deterministic); a crash in the model's code gets no "Resume with";
- ``--max-restarts``: "rank 1 died (SIGKILL); restarting from step N (attempt 2 of 3)";
- SIGTERM to the launcher, to the ranks, or to all of them at once stops a run whose steps
  are slow (each a C call of seconds) within a few seconds, with exit code 143;
- SIGTERM after the ``end`` record: exit 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moebit.cli.launch import run_ranks
from moebit.runs.runtime import ENV_GRACE

from launches import children, wait_for_checkpoint

TESTS = str(Path(__file__).parents[1])
MODULE = "reliability.rank_behaviour"
TINY = ["--nproc", "2", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--block-size",
        "32", "--batch-size", "4", "--samples", "0", "--dtype", "fp32", "--eval-batches", "1",
        "--threads", "1", "--log-every", "1", "--save-every", "5", "--eval-every", "1000"]


@pytest.fixture(autouse=True)
def ranks_import_the_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))


def kill_rank_1_after_a_checkpoint(run: Path, corpus: Path, *extra: str) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "moebit.cli", "train", *TINY, "--data",
                             str(corpus), "--run-dir", str(run), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_for_checkpoint(proc, run)
        ranks = {}
        for pid in children(proc.pid):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e for e in env if e.startswith(b"RANK=")]
            if rank:
                ranks[int(rank[0][5:])] = pid
        os.kill(ranks[1], signal.SIGKILL)
        out = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


@pytest.mark.slow
def test_a_killed_rank_is_named_once_per_rank_with_its_signal(tmp_path: Path, small_corpus: Path):
    run = tmp_path / "run"
    code, out = kill_rank_1_after_a_checkpoint(run, small_corpus, "--steps", "2000")
    assert code == 2, out[-3000:]
    assert "StopRequested" not in out and "Traceback" not in out, out[-3000:]
    tail = out[out.index("moebit train: error: training failed:"):].strip().splitlines()
    assert tail == ["moebit train: error: training failed:", "  rank 1: died (SIGKILL)",
                    "  rank 0: stopped after rank 1 died",
                    f"(tracebacks: {run}/attempts/1/errors.txt)",
                    f"Resume with: moebit train --resume {run}"], tail
    errors = (run / "attempts" / "1" / "errors.txt").read_text()
    assert "--- rank 1\nkilled by SIGKILL: no traceback" in errors


@pytest.mark.slow
def test_max_restarts_says_who_died_and_where_it_restarts(tmp_path: Path, small_corpus: Path):
    run = tmp_path / "run"
    code, out = kill_rank_1_after_a_checkpoint(run, small_corpus, "--steps", "60",
                                               "--max-restarts", "2")
    assert code == 0, out[-3000:]
    lines = [x for x in out.replace("\r", "\n").splitlines() if "restarting" in x]
    assert len(lines) == 1 and re.fullmatch(
        r"moebit: rank 1 died \(SIGKILL\); restarting from step (\d+) \(attempt 2 of 3\)",
        lines[0]), lines
    step = int(re.search(r"from step (\d+)", lines[0]).group(1))
    resumes = [r for r in (run / "metrics.jsonl").read_text().splitlines() if '"resume"' in r]
    assert len(resumes) == 1 and f'"step": {step}' in resumes[0]
    assert (run / "attempts" / "1" / "errors.txt").read_text().startswith("--- rank 1\nkilled by SIGKILL")


def test_a_crash_in_model_code_offers_no_resume(finished_run: Path):
    with pytest.raises(RuntimeError) as e:
        run_ranks({"nproc": 2}, MODULE, ["crash", str(finished_run)], "training",
                  f"Resume with: moebit train --resume {finished_run}", run_dir=finished_run)
    assert str(e.value).startswith("training failed: rank 1: RuntimeError: mat1 and mat2 shapes")
    assert "Resume with" not in str(e.value)


def test_a_full_disk_offers_a_resume(finished_run: Path):
    with pytest.raises(RuntimeError) as e:
        run_ranks({"nproc": 2}, MODULE, ["disk", str(finished_run)], "training",
                  f"Resume with: moebit train --resume {finished_run}", run_dir=finished_run)
    assert "rank 1: OSError: [Errno 28] No space left on device" in str(e.value)
    assert str(e.value).endswith(f"Resume with: moebit train --resume {finished_run}")


def start_launcher(folder: Path, behaviour: str, ready: str) -> subprocess.Popen:
    code = ("import sys; from pathlib import Path; from moebit.cli import launch\n"
            "try: launch.run_ranks({'nproc': 2}, " + repr(MODULE) + ", [sys.argv[1], sys.argv[2]],"
            " 'training', 'Resume with: moebit train --resume R', run_dir=Path(sys.argv[2]))\n"
            "except launch.RunStopped as e: print(e); sys.exit(e.code)\n"
            "print('finished')")
    proc = subprocess.Popen([sys.executable, "-c", code, behaviour, str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, **{ENV_GRACE: "2"}))
    deadline = time.monotonic() + 120
    while len(list(folder.glob(f"rank-*.{ready}"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("target", ["everyone", "launcher", "ranks"])
def test_sigterm_stops_slow_steps_within_seconds(tmp_path: Path, target: str):
    proc = start_launcher(tmp_path, "slow", "stepping")
    ranks = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid")]
    time.sleep(0.5)  # inside a step's C call
    t0 = time.monotonic()
    if target == "everyone":
        os.killpg(proc.pid, signal.SIGTERM)
    for pid in ([proc.pid] if target == "launcher" else ranks if target == "ranks" else []):
        os.kill(pid, signal.SIGTERM)
    try:
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - t0
    assert proc.returncode == 143, out
    assert "Traceback" not in out and out.strip().splitlines()[-1].startswith("training stopped"), out
    # A step's C call takes 10-60 s: without the stop thread the ranks noticed the signal
    # only after it (or torchrun killed them after its 30 s). The grace is 2 s.
    assert took < 10.0, f"{target}: stopped after {took:.1f} s\n{out}"


def test_sigterm_after_the_end_record_exits_0(tmp_path: Path):
    proc = start_launcher(tmp_path, "finish", "done")
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert out.strip().splitlines()[-1] == "finished", out


def test_a_rank_that_handles_sigterm_itself_keeps_its_handler(tmp_path: Path):
    """moebit serve's ranks ignore SIGTERM until rank 0 has drained: no grace kills them."""
    proc = start_launcher(tmp_path, "ignore", "ignoring")
    for p in tmp_path.glob("rank-*.pid"):
        os.kill(int(p.read_text()), signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert len(list(tmp_path.glob("rank-*.survived"))) == 2, out
