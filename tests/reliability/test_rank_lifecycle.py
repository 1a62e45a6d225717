"""Issue 21 items 4, 6 and 7 through the real launcher (torchrun) with light ranks: one line
per distinct rank error, ranks that die with a kill -9'd launcher, a one-line stop."""

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

from moebit.cli.launch import run_ranks
from moebit.runs.runtime import ENV_ERRORS

TESTS = str(Path(__file__).parents[1])
MODULE = "reliability.rank_behaviour"


@pytest.fixture(autouse=True)
def ranks_import_the_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))


def test_the_same_error_on_every_rank_is_one_line(tmp_path: Path, capfd):
    with pytest.raises(RuntimeError) as e:
        run_ranks({"nproc": 2}, MODULE, ["fail-all", str(tmp_path)], "training",
                  "Resume with: moebit train --resume RUN", run_dir=tmp_path)
    # Both ranks raise; the one the agent stops first may not get to record it.
    assert re.fullmatch(r"training failed: (ranks 0, 1|rank 0|rank 1): ValueError: bad key 'x' in "
                        r"f\.json", str(e.value)), str(e.value)
    assert "Traceback" not in capfd.readouterr().err


def test_one_ranks_error_is_named_and_resume_is_not_offered(tmp_path: Path, capfd):
    with pytest.raises(RuntimeError) as e:
        run_ranks({"nproc": 2}, MODULE, ["fail-one", str(tmp_path)], "training",
                  "Resume with: moebit train --resume RUN", run_dir=tmp_path)
    assert str(e.value) == (f"training failed: rank 1: CheckpointError: checkpoint file "
                            f"{tmp_path}/rank-00001.pt is corrupted")
    assert "Traceback" not in capfd.readouterr().err


def test_a_stop_while_an_error_is_recorded_raises_nothing_more(tmp_path: Path):
    """The agent stops rank 0 while it records its own (peer-gone) error: the error is
    recorded and the rank exits 1, without a StopRequested traceback."""
    errors = tmp_path / "errors"
    errors.mkdir()
    env = {**os.environ, "RANK": "0", ENV_ERRORS: str(errors)}
    proc = subprocess.run([sys.executable, "-m", "moebit.runs.runtime", MODULE,
                           "stopped-while-recording", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "StopRequested" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    record = json.loads((errors / "rank-00000.json").read_text())
    assert record["type"] == "StoppedWhileDescribed"
    assert record["message"] == "Connection closed by peer"


def start_launcher(tmp_path: Path) -> subprocess.Popen:
    code = ("import sys; from moebit.cli import launch\n"  # as moebit.cli.main reports a stop
            f"try: launch.run_ranks({{'nproc': 2}}, {MODULE!r}, ['sleep', sys.argv[1]], 'test')\n"
            "except launch.RunStopped as e: print(e); sys.exit(e.code)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("rank-*.pid"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    return proc


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_ranks_exit_within_10s_of_a_kill_9_of_the_launcher(tmp_path: Path):
    proc = start_launcher(tmp_path)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid")]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher by 10 s"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_is_one_line_and_its_exit_code(tmp_path: Path, sig: int, code: int):
    proc = start_launcher(tmp_path)
    os.kill(proc.pid, sig)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == code, out
    assert "Traceback" not in out and "test stopped" in out, out
