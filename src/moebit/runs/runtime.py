"""Start-up and exit of one rank: the launcher runs ``python -m moebit.runs.runtime MODULE ARGS``.

Every rank of ``moebit train``, ``distill`` and ``generate`` starts here, then calls
``MODULE.main(ARGS)``. What this adds around it, and why:

- **Die with the launcher.** torchrun starts the ranks in sessions of their own, so a
  ``kill -9`` of the launcher used to leave them training. ``PR_SET_PDEATHSIG`` makes the
  kernel kill a rank when its parent (the launcher: torchrun's agent runs in-process)
  dies; elsewhere a watchdog thread polls the parent pid.
- **The run folder's lock.** A rank refuses to start unless its launcher holds the run
  folder's lock (``moebit.runs.lock``).
- **A clean stop, promptly.** SIGINT / SIGTERM raise ``StopRequested`` in the main thread;
  the rank then exits quietly with 130 / 143, and the launcher prints the one stop line.
  A Python signal handler runs only between bytecodes, so a rank inside a long matmul or
  a collective waiting on a busy peer used to notice the signal only when that call
  returned (a slow step: many seconds). So the signals are blocked in every thread and a
  small thread takes them with ``sigwait``: it raises ``StopRequested`` in the main thread
  (``_thread.interrupt_main``) and, if the rank is still alive ``MOEBIT_STOP_GRACE_S``
  seconds later (default 2), ends it with ``os._exit(128 + signal)``. That is safe: every
  file a rank writes is atomic, and the launcher removes a checkpoint left without its
  manifest.
- **Done is done.** Once the loop has written the run's ``end`` record (``work_done``), a
  stop signal no longer turns the finished run into a stopped one: the rank exits 0.
- **One line per error.** An exception is written to ``$MOEBIT_ERROR_DIR/rank-N.json``
  (type, message, traceback) instead of a traceback on stderr; the launcher prints each
  distinct error once, naming the ranks.
- **A plain exit.** See ``finish``.
"""

from __future__ import annotations

import _thread
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
ENV_GRACE = "MOEBIT_STOP_GRACE_S"
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Once the work is done (the end record is written), a stop still lets the rank finish
# its last writes (plots, trackers) for this long before it exits 0.
DONE_GRACE_S = 20.0
_stop_signal: list[int] = []
_done = threading.Event()  # the run's work is complete: a stop signal now means exit 0
_exiting = threading.Event()  # finish() runs: a stop signal must not raise in atexit handlers


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
    if _stop_signal or _done.is_set() or _exiting.is_set():
        return  # already stopping, finished, or leaving: let that run to its end
    _stop_signal.append(signum)
    raise StopRequested(signum)


def work_done() -> None:
    """The run's work is complete (its ``end`` record is written): a stop signal from now
    on ends the rank with 0, not 130 / 143."""
    _done.set()


def _grace_s() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_GRACE, "2")))
    except ValueError:
        return 2.0


def _take_signals() -> None:
    """The stop-signal thread: the first signal raises ``StopRequested`` in the main thread;
    a rank still alive after the grace period (more signals do not shorten it) leaves.

    A module that installed its own handler (``moebit serve``: uvicorn drains on SIGTERM,
    the other ranks ignore it until rank 0 tells them to stop) keeps it: its handler is
    called as the signal's own would be, ignored stays ignored, and no grace applies.
    """
    while True:
        signum = int(signal.sigwait(set(STOP_SIGNALS)))
        handler = signal.getsignal(signum)
        if handler is _on_stop:
            break
        if handler == signal.SIG_IGN:
            continue
        if handler in (signal.SIG_DFL, None):
            os._exit(128 + signum)
        _thread.interrupt_main(signum)  # runs that handler in the main thread
    grace = DONE_GRACE_S if _done.is_set() else _grace_s()
    _thread.interrupt_main(signum)
    deadline = time.monotonic() + grace
    while (left := deadline - time.monotonic()) > 0:
        signal.sigtimedwait(set(STOP_SIGNALS), left)  # later signals: already stopping
    code = 0 if _done.is_set() else 128 + signum
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):
            pass
    os._exit(code)


def install_stop_handlers() -> None:
    """SIGINT / SIGTERM become ``StopRequested`` in the main thread, promptly (see the
    module docstring). Call before any other thread starts: threads inherit the blocked
    signals, so only the stop-signal thread receives them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop)
    if not hasattr(signal, "pthread_sigmask") or not hasattr(signal, "sigtimedwait"):
        return  # no sigwait (not POSIX): the handler alone, between bytecodes
    signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    threading.Thread(target=_take_signals, name="moebit-stop-signals", daemon=True).start()


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
        # Leaving with this error: a stop signal now (the agent stopping the ranks after a
        # peer died) must not raise inside the recording and print a second traceback.
        _exiting.set()
        record_error(e)
        return 1


def finish(code: int) -> None:
    """Run the atexit handlers, flush, and leave with ``os._exit``.

    Why not a normal exit: in a training rank gloo's threads (``gloo_tcp_loop``,
    ``pt_gloo_runloop``) are still alive after ``destroy_process_group`` (something still
    holds the group), so interpreter finalization tears down those C++ objects while their
    threads run, in no defined order: the occasional "terminate called without an active
    exception" (SIGABRT) after a finished run. The rank's work, files and process group are
    closed by now; atexit handlers (log and event writers) still run here. A stop signal
    that arrives now raises nothing (it used to print a traceback from an atexit handler).
    """
    _exiting.set()
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
    install_stop_handlers()  # first: a thread started before it could take the signals
    launcher = os.environ.get(runlock.ENV_LAUNCHER)
    try:
        if launcher:
            die_with_parent(int(launcher))
        runlock.check_held()
    except runlock.RunLockError as e:
        record_error(e)
        finish(1)
    except StopRequested as e:  # stopped before the work began
        finish(128 + e.signum)
    finish(run_module(argv[0], argv[1:]))


if __name__ == "__main__":
    main()
