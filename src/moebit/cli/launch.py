"""The one torchrun launcher: ``moebit train``, ``distill`` and ``generate`` start their ranks here.

This process validates (``moebit.cli.validate``), owns the run folder (its lock, for the
whole run), writes the resolved config, and supervises; the ranks run ``python -m
moebit.runs.runtime MODULE ARGS`` through ``torch.distributed.run`` (torchrun), single-node
with ``--standalone`` or multi-node with the c10d rendezvous, exactly as torchrun would.
``moebit.runs.runtime`` ties each rank to this process (it dies with it), checks the lock,
and turns errors and stop signals into records this module reports in one line each.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import ProcessFailure, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from moebit.checkpoint import latest, read_manifest, remove_incomplete, write_text_atomic
from moebit.cli.args import RunStopped, UsageError
from moebit.cli.signals import restore_signal_handlers, signal_handlers
from moebit.runs import dtype_probe, metrics
from moebit.runs import lock as runlock
from moebit.runs.runtime import ENV_ERRORS
from moebit.training.config import TrainConfig

LAUNCH_FLAGS = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "max_restarts", "force")
# Errors a resume can get past (a full disk, memory, a lost connection): only after these,
# or a rank killed by a signal, is "Resume with" offered. Anything else (the config, the
# corpus, a checkpoint, a non-finite loss, a crash in the model's code) a resume meets again.
TRANSIENT = {"OSError", "IOError", "MemoryError", "TimeoutError", "ConnectionError",
             "ConnectionResetError", "ConnectionRefusedError", "BrokenPipeError",
             "DistBackendError", "DistNetworkError", "DistStoreError"}
# A rank whose peer died sees a broken connection: an echo of the real error, not a cause.
ECHOES = ("DistBackendError", "DistNetworkError", "DistStoreError")
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "Connection refused", "Socket Timeout", "recvBytes", "sendBytes")
STOP_NAMES = ("SIGINT", "SIGTERM")
# How a rank ends when the agent stops it (SIGINT / SIGTERM, handled or not).
STOPPED = {int(signal.SIGINT), int(signal.SIGTERM), 128 + int(signal.SIGINT), 128 + int(signal.SIGTERM)}
_HELD: dict[str, runlock.RunLock] = {}
_DTYPE: dict[str, dtype_probe.Choice] = {}  # run folder -> how its dtype was chosen


def add_launch_flags(ap: argparse.ArgumentParser, default_nproc: int = 2) -> None:
    launch = ap.add_argument_group("launch (torchrun)")
    launch.add_argument("--nproc", type=int, help=f"ranks on this machine (default {default_nproc})")
    launch.add_argument("--nnodes", type=int, help="machines taking part (default 1)")
    launch.add_argument("--node-rank", type=int, help="this machine's index (multi-node)")
    launch.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous (multi-node)")
    launch.add_argument("--rdzv-id", help="rendezvous id shared by all nodes (default moebit)")
    launch.add_argument("--max-restarts", type=int, help="restart failed ranks this many times")
    launch.add_argument("--force", action="store_true",
                        help="start even with far more ranks than cores or too little free memory")


def pop_launch(given: dict[str, Any]) -> dict[str, Any]:
    """Take the launcher's flags out of parsed flags, leaving the config's."""
    return {k: given.pop(k) for k in LAUNCH_FLAGS if k in given}


def prepare_run_dir(cfg: TrainConfig, command: str = "train", node_rank: int = 0,
                    nnodes: int = 1) -> Path:
    """Create the run folder, take its lock, and write this attempt's resolved config.

    Call only after every check passed: nothing is written before. ``config.json`` is
    replaced atomically; each attempt's own copy stays in ``attempts/N/config.json``.
    ``--dtype auto`` is resolved here, once (``moebit.runs.dtype_probe``), and the choice
    printed with its reason: the config the ranks read names bf16 or fp32.
    """
    run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--run-dir {str(run_dir)!r} is not writable: {e}") from None
    if node_rank == 0:
        _HELD[str(run_dir)] = runlock.acquire(run_dir, f"moebit {command}")
    if (run_dir / metrics.FILE_NAME).exists() and not cfg.resume:
        release_run_dir(run_dir)
        raise UsageError(
            f"--run-dir {str(run_dir)!r} already holds a run (metrics.jsonl): pick another folder"
        )
    cfg.run_dir = str(run_dir)
    choice = dtype_probe.resolve(cfg.dtype, cfg.device, nnodes)
    if choice.requested == "auto":
        print(f"moebit {command}: {choice.line()}", file=sys.stderr, flush=True)
    cfg.dtype = choice.dtype
    _DTYPE[str(run_dir)] = choice
    text = json.dumps(cfg.to_dict(), indent=2) + "\n"
    attempts = run_dir / "attempts"
    n = 1 + max((int(p.name) for p in attempts.glob("*") if p.name.isdigit()), default=0)
    write_text_atomic(text, attempts / str(n) / "config.json")
    write_text_atomic(text, run_dir / "config.json")
    return run_dir


def release_run_dir(run_dir: Path) -> None:
    _DTYPE.pop(str(run_dir), None)
    lock = _HELD.pop(str(run_dir), None)
    if lock is not None:
        lock.release()


def set_aside_newer(run_dir: Path, chosen: Path) -> list[Path]:
    """Resuming from an older checkpoint: move the newer ones out of the way (renamed
    ``discarded-step-N``), so that neither a restart nor a later resume picks them."""
    moved = []
    for d in sorted((run_dir / "checkpoints").glob("step-*")):
        if d.name > chosen.name:
            target = d.with_name(f"discarded-{d.name}-{int(time.time())}")
            d.rename(target)
            moved.append(target)
    return moved


def torchrun_args(launch: dict[str, Any], module: str, module_args: list[str]) -> list[str]:
    nproc = int(launch.get("nproc", 2))
    nnodes = int(launch.get("nnodes", 1))
    if nproc < 1 or nnodes < 1:
        raise UsageError("--nproc and --nnodes must be >= 1")
    args = ["--nproc-per-node", str(nproc), "--max-restarts", str(launch.get("max_restarts", 0))]
    if nnodes > 1:
        if "rdzv_endpoint" not in launch:
            raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        args += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", launch["rdzv_endpoint"],
                 "--rdzv-id", str(launch.get("rdzv_id", "moebit"))]
        if "node_rank" in launch:
            args += ["--node-rank", str(launch["node_rank"])]
    else:
        args += ["--standalone"]
    if "signals_to_handle" in launch:  # signals torchrun answers by stopping every rank
        args += ["--signals-to-handle", str(launch["signals_to_handle"])]
    # Every rank starts in moebit.runs.runtime, which then runs MODULE.main(module_args).
    return args + ["--module", "moebit.runs.runtime", module, *module_args]


def check_rendezvous_port(launch: dict[str, Any]) -> None:
    """On the node that hosts the rendezvous, fail early and clearly if its port is taken."""
    if int(launch.get("nnodes", 1)) <= 1 or int(launch.get("node_rank", 0)) != 0:
        return
    host, _, port = str(launch.get("rdzv_endpoint", "")).rpartition(":")
    if not port.isdigit():
        raise UsageError(f"--rdzv-endpoint {launch.get('rdzv_endpoint')!r}: expected HOST:PORT")
    if host not in ("127.0.0.1", "localhost", socket.gethostname(), "0.0.0.0", ""):
        return  # another machine's address: it hosts the store
    with socket.socket() as s:
        try:
            s.bind(("" if host == "0.0.0.0" else "127.0.0.1", int(port)))
        except OSError:
            raise UsageError(
                f"--rdzv-endpoint {launch['rdzv_endpoint']}: port {port} is already in use "
                "on this machine; pick a free port") from None


def run_ranks(launch: dict[str, Any], module: str, module_args: list[str], what: str,
              after_failure: str = "", run_dir: Path | None = None) -> None:
    """Run the ranks to completion.

    A failure becomes one RuntimeError with a line per distinct rank error (and, when a
    rank was killed, a line per rank); ``after_failure`` (e.g. how to resume) is added only
    when a retry can succeed: a complete checkpoint exists and the cause is not one a retry
    would meet again. SIGINT / SIGTERM become ``RunStopped`` with the stop line and the exit
    code 130 / 143, unless the run had already finished (its ``end`` record is written):
    then it returns as done. Under ``--max-restarts`` each restart prints one line.
    """
    check_rendezvous_port(launch)
    args = torchrun_args(launch, module, module_args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks set their own thread count
    quiet_torchrun()
    errors = Path(tempfile.mkdtemp(prefix="moebit-errors-"))
    env = {ENV_ERRORS: str(errors), runlock.ENV_LAUNCHER: str(os.getpid())}
    if run_dir is not None and str(run_dir) in _HELD:
        env[runlock.ENV_LOCK] = str(_HELD[str(run_dir)].path)
    if run_dir is not None and str(run_dir) in _DTYPE:
        env[dtype_probe.ENV_CHOICE] = dtype_probe.to_env(_DTYPE[str(run_dir)])
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    end_before = last_end(run_dir)
    handlers = signal_handlers()
    try:
        with restart_notices(errors, what, run_dir, int(launch.get("max_restarts", 0) or 0)):
            run(get_args_parser().parse_args(args))
    except ChildFailedError as e:
        if run_dir is not None:
            remove_incomplete(run_dir)  # every rank is gone: a half-written save is debris
        stopped = stopped_by(e, errors)
        if stopped is not None:  # a rank was sent SIGINT / SIGTERM directly: a stop
            leave_promptly(128 + stopped)
            raise RunStopped(stop_line(what, run_dir, after_failure), 128 + stopped) from None
        raise RuntimeError(failure_message(e.failures, errors, what, after_failure, run_dir)) from None
    except SignalException as e:
        if run_dir is not None:
            remove_incomplete(run_dir)
        if run_dir is not None and last_end(run_dir) not in (None, end_before):
            return  # the signal came after the run finished: it is done, not stopped
        leave_promptly(128 + int(e.sigval))
        raise RunStopped(stop_line(what, run_dir, after_failure), 128 + int(e.sigval)) from None
    finally:
        restore_signal_handlers(handlers)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(errors, ignore_errors=True)


@contextlib.contextmanager
def restart_notices(errors: Path, what: str, run_dir: Path | None, max_restarts: int
                    ) -> Iterator[None]:
    """While torchrun runs: before each ``--max-restarts`` restart print why and from where,
    "rank 1 died (SIGKILL); restarting from step 40 (attempt 2 of 3)", keep the failed
    attempt's tracebacks, and clear its records (the next attempt's errors are its own).

    torchrun's agent restarts the ranks inside ``run()``; its ``_restart_workers`` (torch
    2.3-2.13: stop the ranks, rendezvous, start them) is wrapped here, in this process only.
    """
    if max_restarts <= 0:
        yield
        return
    original = LocalElasticAgent._monitor_workers
    restart = LocalElasticAgent._restart_workers
    seen: dict[str, Any] = {}

    def monitor(agent: Any, group: Any) -> Any:
        result = original(agent, group)
        if result.is_failed():
            seen["failures"] = dict(result.failures)
        return result

    def restart_workers(agent: Any, group: Any) -> None:
        agent._stop_workers(group)  # every rank of the failed attempt is gone after this
        attempt = max_restarts - agent._remaining_restarts + 1
        print(restart_line(seen.pop("failures", {}), errors, what, run_dir, attempt,
                           max_restarts + 1), file=sys.stderr, flush=True)
        restart(agent, group)

    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    LocalElasticAgent._restart_workers = restart_workers  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]
        LocalElasticAgent._restart_workers = restart  # type: ignore[method-assign]


def restart_line(failures: dict[int, ProcessFailure], errors: Path, what: str,
                 run_dir: Path | None, attempt: int, attempts: int) -> str:
    """One line: what failed, and the step the next attempt resumes from."""
    records = read_errors(errors)
    if run_dir is not None:
        remove_incomplete(run_dir)  # a save the failed attempt left half-written
    why = failure_message(failures, errors, what, "", run_dir).splitlines()[0]
    why = why.removeprefix(f"{what} failed: ").removesuffix(":")
    dead = {r: n for r, f in failures.items() if (n := _signal_name(f)) and n not in STOP_NAMES
            and r not in {int(x["rank"]) for x in records}}
    if dead:
        why = "; ".join(f"rank {r} died ({n})" for r, n in sorted(dead.items()))
    for f in errors.glob("rank-*.json"):
        f.unlink(missing_ok=True)
    ckpt = latest(run_dir) if run_dir is not None else None
    where = f"from step {read_manifest(ckpt)['step']}" if ckpt is not None else "from the start"
    return f"moebit: {why}; restarting {where} (attempt {attempt} of {attempts})"


def leave_promptly(code: int) -> None:
    """After a stop, end this process right after its atexit handlers, as ``code``.

    A torchrun stopped by a signal leaves its rendezvous objects behind, and tearing them
    down at interpreter exit took 4-6 s here after the ranks were long gone: a stop is
    prompt only if the launcher is too. Registered last, this runs before the earlier
    atexit handlers; it runs them itself, flushes, then leaves with ``os._exit``.
    """
    def leave() -> None:
        atexit.unregister(leave)
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)

    atexit.register(leave)


def last_end(run_dir: Path | None) -> dict[str, Any] | None:
    """The run's last record when it is an ``end`` record (the run finished), else None."""
    if run_dir is None or not (run_dir / metrics.FILE_NAME).is_file():
        return None
    recs = metrics.read_run(run_dir)
    return recs[-1] if recs and recs[-1].get("kind") == "end" else None


def quiet_torchrun() -> None:
    """Silence torchrun's own log lines (each module's logger has its own level): this
    launcher reports failures and stops itself, once."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def read_errors(folder: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(folder.glob("rank-*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def _signal_name(failure: ProcessFailure) -> str | None:
    """The signal that ended a rank: killed by it (negative exit code), or an exit with
    128 + N as ``moebit.runs.runtime`` leaves on SIGKILL of its launcher."""
    code = failure.exitcode
    num = -code if code < 0 else code - 128 if code in (128 + int(signal.SIGKILL),) else None
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def stopped_by(e: ChildFailedError, folder: Path) -> int | None:
    """The stop signal when every failed rank exited as stopped (130 / 143, or killed by
    SIGINT / SIGTERM) and none recorded an error: someone signalled the ranks themselves."""
    if read_errors(folder) or not e.failures:
        return None
    codes = {abs(f.exitcode) for f in e.failures.values()}
    if not codes <= STOPPED:
        return None
    return max(c - 128 if c > 128 else c for c in codes)


def is_echo(record: dict[str, Any]) -> bool:
    """A rank's error that only says a peer went away (its cause is elsewhere)."""
    return record["type"] in ECHOES or any(p in str(record["message"]) for p in PEER_GONE)


def _first_line(record: dict[str, Any]) -> str:
    text = str(record["message"]).strip()
    return text.splitlines()[0] if text else ""


def failure_message(failures: dict[int, ProcessFailure], folder: Path, what: str,
                    after_failure: str, run_dir: Path | None) -> str:
    """One line per distinct error: the ranks, the error type, its message (which names the
    file or key). A rank killed by a signal (e.g. SIGKILL: no record) is named with the
    signal, and then every other rank gets its own line saying it stopped because of it;
    the broken connections those ranks saw are echoes, not causes."""
    records = read_errors(folder)
    by_rank = {int(r["rank"]): r for r in records}
    dead = {rank: name for rank, f in failures.items()
            if rank not in by_rank and (name := _signal_name(f)) and name not in STOP_NAMES}
    causes = [r for r in records if not is_echo(r)] if dead or any(
        not is_echo(r) for r in records) else records
    lines: dict[str, list[int]] = {}
    for rank, name in sorted(dead.items()):
        lines.setdefault(f"died ({name})", []).append(rank)
    for r in causes:
        lines.setdefault(f"{r['type']}: {_first_line(r)}", []).append(int(r["rank"]))
    for rank, f in sorted(failures.items()):
        if rank in dead or rank in {int(r["rank"]) for r in causes}:
            continue
        if dead:  # the dead rank's peers: one line each
            lines.setdefault(f"stopped after rank {', '.join(map(str, sorted(dead)))} died",
                             []).append(rank)
        elif rank not in by_rank and abs(f.exitcode) not in STOPPED:
            lines.setdefault(f"(exit code {f.exitcode}); the other ranks were stopped", []).append(rank)
    if not lines:
        lines["(no error recorded); the other ranks were stopped"] = [min(failures, default=0)]
    body = []
    for text, ranks in lines.items():
        if text.startswith(("died", "stopped after")):
            body += [f"rank {r}: {text}" for r in sorted(ranks)]  # one line per rank
        else:
            body.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}: {text}")
    retry = bool(after_failure) and run_dir is not None and latest(run_dir) is not None and all(
        transient(r) for r in causes)
    msg = f"{what} failed: " + body[0] if len(body) == 1 else f"{what} failed:\n  " + "\n  ".join(body)
    kept = keep_tracebacks(records, dead, run_dir)
    return msg + (f"\n(tracebacks: {kept})" if kept else "") + (f"\n{after_failure}" if retry else "")


def transient(record: dict[str, Any]) -> bool:
    """Whether a resume can get past this error: an OS-level fault (a full disk, a lost
    connection, memory), not the config, the data, a checkpoint or the model's own code."""
    return record["type"] in TRANSIENT or is_echo(record)


def keep_tracebacks(records: list[dict[str, Any]], dead: dict[int, str],
                    run_dir: Path | None) -> Path | None:
    """The ranks' full tracebacks, for whoever debugs: RUN/attempts/N/errors.txt (a rank
    killed by a signal has none; its entry says so)."""
    attempts = run_dir / "attempts" if run_dir is not None else None
    if not (records or dead) or attempts is None or not attempts.is_dir():
        return None
    last = max((p for p in attempts.iterdir() if p.name.isdigit()), key=lambda p: int(p.name),
               default=None)
    if last is None:
        return None
    text = "\n".join([f"--- rank {rank}\nkilled by {name}: no traceback (the process was ended "
                      "from outside, e.g. kill -9 or the kernel's out-of-memory killer)\n"
                      for rank, name in sorted(dead.items())]
                     + [f"--- rank {r['rank']}\n{r['traceback']}" for r in records])
    try:
        write_text_atomic(text, last / "errors.txt")
    except OSError:
        return None  # a full or read-only disk: the one-line errors are still printed
    return last / "errors.txt"


def stop_line(what: str, run_dir: Path | None, resume: str) -> str:
    """"stopped at step N; last checkpoint step M; resume with ..." (N: the last step the
    metrics recorded, at --log-every granularity)."""
    if run_dir is None:
        return f"{what} stopped"
    step = metrics.last_step(run_dir)
    ckpt = latest(run_dir)
    saved = read_manifest(ckpt)["step"] if ckpt is not None else None
    text = f"{what} stopped at step {step if step is not None else 0}; "
    if saved is None:
        return text + "no checkpoint yet (nothing to resume; start again)"
    return text + f"last checkpoint step {saved}; {resume[0].lower() + resume[1:] if resume else ''}"


def print_run_folder(run_dir: Path, cmd: str, extra: str = "") -> None:
    print(f"moebit {cmd}: run folder {run_dir}{extra}", file=sys.stderr)
