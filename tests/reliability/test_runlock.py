"""Issue 21 item 1 (unit level): one live owner per run folder, named when refused; the
ranks' check; a dead owner's record is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moebit.runs import lock as runlock


def test_second_owner_is_refused_with_one_line_naming_the_first(tmp_path: Path):
    first = runlock.acquire(tmp_path, "moebit train")
    try:
        with pytest.raises(runlock.RunLockError) as e:
            runlock.acquire(tmp_path, "moebit train")
        msg = str(e.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and "\n" not in msg
    finally:
        first.release()
    runlock.acquire(tmp_path, "moebit train").release()  # free again


def test_lock_of_a_killed_owner_is_free_and_its_record_is_reported_stale(tmp_path: Path):
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from moebit.runs import lock as runlock; "
            "runlock.acquire(sys.argv[1], 'moebit train'); print('held', flush=True); time.sleep(60)")
    src = str(Path(runlock.__file__).parents[1])
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), src], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(runlock.RunLockError, match=f"pid {proc.pid}"):
            runlock.acquire(tmp_path, "moebit train")
    finally:
        proc.kill()
        proc.wait()
    lock = runlock.acquire(tmp_path, "moebit train")  # no manual cleanup needed after kill -9
    try:
        assert lock.stale and lock.stale["pid"] == proc.pid
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_ranks_refuse_to_start_without_their_launchers_lock(tmp_path: Path):
    env = {runlock.ENV_LOCK: str(tmp_path / ".lock"), runlock.ENV_LAUNCHER: str(os.getpid())}
    with pytest.raises(runlock.RunLockError, match="not held"):
        runlock.check_held(env)  # no lock at all
    lock = runlock.acquire(tmp_path, "moebit train")
    try:
        runlock.check_held(env)  # held by "our launcher" (this process)
        with pytest.raises(runlock.RunLockError, match="refusing to start"):
            runlock.check_held({**env, runlock.ENV_LAUNCHER: "1"})  # another launcher's run
    finally:
        lock.release()
    runlock.check_held({})  # not started by a launcher: nothing to check
