"""The ``moebit`` command: train, report, demo and benchmarks.

    moebit train --nproc 2 --steps 300                 # 2 ranks on this machine
    moebit train --config run.toml --lr 3e-4           # a file, flags override it
    moebit train --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 ...   # multi-node
    moebit report runs/a runs/b                         # curves on shared axes + table
    moebit bench comm --link 1gbit                      # benchmarks (see docs/benchmarks.md)
    moebit generate runs/a --prompt "def "              # text from a trained run
    moebit eval runs/a runs/b                           # val loss on the whole split
    moebit distill --teacher runs/a --student-layers 3  # Mixture-of-Students
    moebit upcycle runs/a --num-experts 8 --run-dir runs/a-moe   # dense -> MoE
    moebit demo                                         # the guided tour

Ranks are launched by torch.distributed.run (torchrun); this process only validates the
configuration, prepares the run folder, and supervises.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from moebit.config import ConfigError, TrainConfig, build, load_file

LAUNCH_FLAGS = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "max_restarts")
INTERNAL_FIELDS = ("extra", "resume")  # not flags: set through a config file / --resume RUN
BENCHMARKS = ("comm", "moe", "train", "inference", "freeze")


class UsageError(ValueError):
    pass


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _train_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="moebit train", argument_default=argparse.SUPPRESS,
        description="Train a byte-level LM on N ranks (launched through torch.distributed.run).",
    )
    launch = ap.add_argument_group("launch (torchrun)")
    launch.add_argument("--nproc", type=int, help="ranks on this machine (default 2)")
    launch.add_argument("--nnodes", type=int, help="machines taking part (default 1)")
    launch.add_argument("--node-rank", type=int, help="this machine's index (multi-node)")
    launch.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous (multi-node)")
    launch.add_argument("--rdzv-id", help="rendezvous id shared by all nodes (default moebit)")
    launch.add_argument("--max-restarts", type=int, help="restart failed ranks this many times")
    ap.add_argument("--config", help="TOML or JSON file with the same settings as the flags")
    ap.add_argument("--resume", metavar="RUN",
                    help="continue RUN from its newest checkpoint (its config; flags override)")
    tr = ap.add_argument_group("training (also keys of --config)")
    for f in fields(TrainConfig):
        if f.name in INTERNAL_FIELDS:
            continue
        if f.type in ("bool", bool):
            tr.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction)
        else:
            tr.add_argument(_flag(f.name), metavar=f.name.upper())
    return ap


def parse_known(ap: argparse.ArgumentParser, argv: list[str],
                cmd: str) -> tuple[argparse.Namespace, list[str]]:
    """argparse's parse_known_args, with its exit on bad input turned into a UsageError
    (``--help`` still exits)."""
    try:
        return ap.parse_known_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --help
            raise
        raise UsageError(f"bad arguments to moebit {cmd} (see above)") from e


def parse_train_args(argv: list[str]) -> tuple[TrainConfig, dict[str, Any]]:
    ap = _train_parser()
    ns, unknown = parse_known(ap, argv, "train")
    if unknown:
        raise UsageError(f"unknown flag {unknown[0]!r} for moebit train (see moebit train --help)")
    given = vars(ns)
    launch = {k: given.pop(k) for k in LAUNCH_FLAGS if k in given}
    if "resume" in given:
        run = Path(given.pop("resume"))
        if "config" in given:
            raise UsageError("--resume RUN takes its settings from RUN/config.json; drop --config")
        if not (run / "config.json").is_file():
            raise UsageError(f"--resume {str(run)!r}: not a run folder (no config.json)")
        file_values = json.loads((run / "config.json").read_text())
        file_values.update(resume=True, run_dir=str(run))
        given.pop("run_dir", None)
        return build(file_values, given, source=f"{run}/config.json"), launch
    file_values = load_file(given.pop("config")) if "config" in given else {}
    cfg = build(file_values, given, source=str(file_values and "--config file"))
    return cfg, launch


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
    from moebit.checkpoint import write_text_atomic

    write_text_atomic(json.dumps(cfg.to_dict(), indent=2) + "\n", run_dir / "config.json")
    return run_dir


def torchrun_args(launch: dict[str, Any], config_path: Path) -> list[str]:
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
    return args + ["--module", "moebit.train", "--resolved-config", str(config_path)]


def check_rendezvous_port(launch: dict[str, Any]) -> None:
    """On the node that hosts the rendezvous, fail early and clearly if its port is taken."""
    import socket

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


def launch_training(cfg: TrainConfig, launch: dict[str, Any]) -> Path:
    """Run the ranks through torch.distributed.run; returns the run folder."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from moebit.data import check_path

    check_path(cfg.data)  # before anything is written or launched
    check_rendezvous_port(launch)
    run_dir = prepare_run_dir(cfg)
    args = torchrun_args(launch, run_dir / "config.json")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks set their own thread count
    print(f"moebit: run folder {run_dir}", file=sys.stderr)
    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = (f"killed by signal {failure.signal_name()}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")
        detail = failure.message if isinstance(failure.message, str) else ""
        raise RuntimeError(
            f"training failed: rank {rank} ({how}); the other ranks were stopped. "
            f"Resume with: moebit train --resume {run_dir}" + (f"\n{detail}" if detail else "")
        ) from None
    return run_dir


def cmd_train(argv: list[str]) -> int:
    cfg, launch = parse_train_args(argv)
    run_dir = launch_training(cfg, launch)
    print(f"moebit: done; metrics and plots in {run_dir}")
    return 0


def cmd_report(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moebit report", description="Compare run folders.")
    ap.add_argument("runs", nargs="+", help="run folders written by moebit train")
    ap.add_argument("--out", help="folder for the plots (default: the run, or the runs' parent)")
    args = ap.parse_args(argv)
    from moebit.report import report

    table, paths = report(args.runs, args.out)
    print(table)
    for p in paths:
        print(f"plot: {p}")
    return 0


def cmd_bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: moebit bench {{{','.join(BENCHMARKS)}}} [options]")
        return 0 if argv else 2
    name = argv[0]
    if name not in BENCHMARKS:
        raise UsageError(f"unknown benchmark {name!r}: choose from {', '.join(BENCHMARKS)}")
    try:
        mod = importlib.import_module(f"moebit.bench.{name}")
    except ModuleNotFoundError as e:
        raise UsageError(f"benchmark {name!r} is not available in this version: {e}") from None
    return int(mod.main(argv[1:]) or 0)


def cmd_demo(argv: list[str]) -> int:
    from moebit.demo import main as demo_main

    return demo_main(argv)


def cmd_generate(argv: list[str]) -> int:
    from moebit.generate_cli import main as generate_main

    return generate_main(argv)


def cmd_eval(argv: list[str]) -> int:
    from moebit.eval_cli import main as eval_main

    return eval_main(argv)


def cmd_distill(argv: list[str]) -> int:
    from moebit.distill_cli import main as distill_main

    return distill_main(argv)


COMMANDS = {"train": cmd_train, "report": cmd_report, "bench": cmd_bench, "demo": cmd_demo,
            "generate": cmd_generate, "eval": cmd_eval, "distill": cmd_distill,
            "upcycle": lambda argv: importlib.import_module("moebit.upcycle_cli").main(argv)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("commands: " + ", ".join(COMMANDS))
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"moebit: unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[cmd](rest)
    except (ConfigError, UsageError, ValueError, RuntimeError) as e:
        print(f"moebit {cmd}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `moebit report ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
