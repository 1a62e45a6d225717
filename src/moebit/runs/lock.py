"""One live run per run folder: an OS lock on ``RUN/.lock``, held by the launcher.

Why flock rather than a lock file created with O_EXCL: the kernel drops a flock when its
holder dies, however it dies (``kill -9`` included), so a lock can never be left behind
by a crash. The file itself stays and records who held it last (pid, host, command,
time); that record is only for messages. A record whose owner is gone but whose lock is
free is stale by construction and is simply taken over.

The descriptor is close-on-exec, so the ranks do not inherit it: they check instead, at
start-up, that the lock is held and that the record names their own launcher
(``check_held``). Ranks left over from a dead launcher therefore cannot join a new run,
and a new launcher never waits for them.

Multi-node runs on a shared folder: only the launcher of node 0 takes the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_NAME = ".lock"
ENV_LOCK = "MOEBIT_RUN_LOCK"  # the lock file, for the ranks' check
ENV_LAUNCHER = "MOEBIT_LAUNCHER_PID"  # the launcher that holds it


class RunLockError(RuntimeError):
    """The run folder belongs to another live run (the message names it)."""


@dataclass
class RunLock:
    path: Path
    fd: int
    stale: dict[str, Any] | None  # the dead previous owner's record, if there was one

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def read_owner(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


def describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "another process (no owner recorded)"
    started = time.strftime("%H:%M:%S", time.localtime(owner.get("started", 0)))
    return (f"{owner.get('command', 'moebit')} (pid {owner.get('pid')} on host "
            f"{owner.get('host')}, started {started})")


def acquire(run_dir: str | os.PathLike[str], command: str) -> RunLock:
    """Take the run folder's lock or raise RunLockError naming the live owner."""
    path = Path(run_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise RunLockError(
            f"run folder {run_dir} is in use by {describe(read_owner(path))}: wait for it to "
            "finish, stop it, or pick another --run-dir") from None
    previous = read_owner(path)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return RunLock(path, fd, previous or None)


def is_locked(path: Path) -> bool:
    """Whether some process holds the lock on ``path`` (we take and drop a shared lock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops our shared lock, if we got it
    return False


def check_held(env: dict[str, str] | None = None) -> None:
    """For a rank: refuse to start unless the lock is held by the launcher that started us."""
    env = dict(os.environ if env is None else env)
    if ENV_LOCK not in env:
        return  # not started by a locking launcher (tests, other nodes of a multi-node run)
    path, launcher = Path(env[ENV_LOCK]), int(env.get(ENV_LAUNCHER, "0"))
    owner = read_owner(path)
    if not is_locked(path) or owner.get("pid") != launcher or owner.get("host") != socket.gethostname():
        raise RunLockError(
            f"{path.parent}: its lock is not held by this rank's launcher (pid {launcher}; "
            f"owner: {describe(owner)}); refusing to start")
