"""The one torchrun launcher: ``moebit train``, ``distill`` and ``generate`` start their ranks here.

This process validates, prepares the run folder and supervises; the ranks run
``python -m MODULE ARGS`` through ``torch.distributed.run`` (torchrun), single-node with
``--standalone`` or multi-node with the c10d rendezvous, exactly as torchrun would.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from moebit.checkpoint import write_text_atomic
from moebit.cli.args import UsageError
from moebit.config import TrainConfig

LAUNCH_FLAGS = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "max_restarts")


def add_launch_flags(ap: argparse.ArgumentParser, default_nproc: int = 2) -> None:
    launch = ap.add_argument_group("launch (torchrun)")
    launch.add_argument("--nproc", type=int, help=f"ranks on this machine (default {default_nproc})")
    launch.add_argument("--nnodes", type=int, help="machines taking part (default 1)")
    launch.add_argument("--node-rank", type=int, help="this machine's index (multi-node)")
    launch.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous (multi-node)")
    launch.add_argument("--rdzv-id", help="rendezvous id shared by all nodes (default moebit)")
    launch.add_argument("--max-restarts", type=int, help="restart failed ranks this many times")


def pop_launch(given: dict[str, Any]) -> dict[str, Any]:
    """Take the launcher's flags out of parsed flags, leaving the config's."""
    return {k: given.pop(k) for k in LAUNCH_FLAGS if k in given}


def prepare_run_dir(cfg: TrainConfig) -> Path:
    run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--run-dir {str(run_dir)!r} is not writable: {e}") from None
    if (run_dir / "metrics.jsonl").exists() and not cfg.resume:
        raise UsageError(
            f"--run-dir {str(run_dir)!r} already holds a run (metrics.jsonl): pick another folder"
        )
    cfg.run_dir = str(run_dir)
    write_text_atomic(json.dumps(cfg.to_dict(), indent=2) + "\n", run_dir / "config.json")
    return run_dir


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
    return args + ["--module", module, *module_args]


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
              after_failure: str = "") -> None:
    """Run the ranks to completion; a failed rank becomes one RuntimeError naming it.

    ``after_failure`` is appended to that message (e.g. how to resume).
    """
    check_rendezvous_port(launch)
    args = torchrun_args(launch, module, module_args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks set their own thread count
    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = (f"killed by signal {failure.signal_name()}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")
        detail = failure.message if isinstance(failure.message, str) else ""
        raise RuntimeError(
            f"{what} failed: rank {rank} ({how}); the other ranks were stopped."
            + (f" {after_failure}" if after_failure else "") + (f"\n{detail}" if detail else "")
        ) from None


def print_run_folder(run_dir: Path, cmd: str, extra: str = "") -> None:
    print(f"moebit {cmd}: run folder {run_dir}{extra}", file=sys.stderr)
