"""Start-up and exit of one rank: the launcher runs ``python -m moebit.runs.runtime MODULE ARGS``.

Every rank of ``moebit train``, ``distill`` and ``generate`` starts here, then calls
``MODULE.main(ARGS)``. What this adds around it, and why:

- **Die with the launcher.** torchrun starts the ranks in sessions of their own, so a
  ``kill -9`` of the launcher used to leave them training. ``PR_SET_PDEATHSIG`` makes the
  kernel kill a rank when its parent (the launcher: torchrun's agent runs in-process)
  dies; elsewhere a watchdog thread polls the parent pid.
- **The run folder's lock.** A rank refuses to start unless its launcher holds the run
  folder's lock (``moebit.runs.lock``).
- **A clean stop.** SIGINT / SIGTERM raise ``StopRequested`` in the main thread; the rank
  then exits quietly with 130 / 143, and the launcher prints the one stop line.
- **One line per error.** An exception is written to ``$MOEBIT_ERROR_DIR/rank-N.json``
  (type, message, traceback) instead of a traceback on stderr; the launcher prints each
  distinct error once, naming the ranks.
- **A plain exit.** See ``finish``.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType

from moebit.runs import lock as runlock

ENV_ERRORS = "MOEBIT_ERROR_DIR"
PR_SET_PDEATHSIG = 1
_stop_signal: list[int] = []


class StopRequested(BaseException):
    """SIGINT or SIGTERM arrived; a BaseException so that no ``except Exception`` in the
    loop swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def die_with_parent(parent: int) -> None:
    """Have this process killed when ``parent`` (the launcher) dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            _watch_parent(parent)
    else:
        _watch_parent(parent)
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(128 + int(signal.SIGKILL))


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(128 + int(signal.SIGKILL))

    threading.Thread(target=watch, name="moebit-parent-watchdog", daemon=True).start()


def _on_stop(signum: int, frame: FrameType | None) -> None:
    if _stop_signal:  # already stopping: let the cleanup run
        return
    _stop_signal.append(signum)
    raise StopRequested(signum)


def install_stop_handlers() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_stop)


def stop_signal() -> int | None:
    return _stop_signal[0] if _stop_signal else None


def record_error(exc: BaseException) -> None:
    """Write the error for the launcher; without an error folder, print a traceback."""
    rank = os.environ.get("RANK", "0")
    folder = os.environ.get(ENV_ERRORS)
    record = {"rank": int(rank), "type": type(exc).__name__, "message": str(exc),
              "traceback": traceback.format_exc()}
    if folder:
        try:
            (Path(folder) / f"rank-{int(rank):05d}.json").write_text(json.dumps(record))
            return
        except OSError:
            pass
    print(record["traceback"], file=sys.stderr)


def run_module(module: str, args: list[str]) -> int:
    """``module.main(args)``; every outcome becomes an exit code (errors are recorded)."""
    try:
        return int(importlib.import_module(module).main(args) or 0)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - turned into an exit code and a record
        signum = stop_signal()
        if signum is not None:  # a stop, or a peer's stop seen as a broken connection
            return 128 + signum
        if isinstance(e, KeyboardInterrupt):
            return 128 + int(signal.SIGINT)
        record_error(e)
        return 1


def finish(code: int) -> None:
    """Run the atexit handlers, flush, and leave with ``os._exit``.

    Why not a normal exit: in a training rank gloo's threads (``gloo_tcp_loop``,
    ``pt_gloo_runloop``) are still alive after ``destroy_process_group`` (something still
    holds the group), so interpreter finalization tears down those C++ objects while their
    threads run, in no defined order: the occasional "terminate called without an active
    exception" (SIGABRT) after a finished run. The rank's work, files and process group are
    closed by now; atexit handlers (log and event writers) still run here.
    """
    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001 - a failing handler must not turn a finished run into a crash
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m moebit.runs.runtime MODULE [ARGS...]", file=sys.stderr)
        finish(2)
    launcher = os.environ.get(runlock.ENV_LAUNCHER)
    if launcher:
        die_with_parent(int(launcher))
    install_stop_handlers()
    try:
        runlock.check_held()
    except runlock.RunLockError as e:
        record_error(e)
        finish(1)
    finish(run_module(argv[0], argv[1:]))


if __name__ == "__main__":
    main()
