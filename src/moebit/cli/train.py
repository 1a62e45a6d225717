"""``moebit train``: resolve the settings (defaults, a file, flags), then launch the ranks.

    moebit train --nproc 2 --steps 300                 # 2 ranks on this machine
    moebit train --config run.toml --lr 3e-4           # a file, flags override it
    moebit train --resume runs/a                       # continue from the newest checkpoint
    moebit train --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 ...   # multi-node
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moebit import tracking
from moebit.cli.args import UsageError, add_config_flags, parse_known, unknown_flag_error
from moebit.cli.launch import add_launch_flags, pop_launch, prepare_run_dir, print_run_folder, run_ranks
from moebit.config import TrainConfig, build, load_file
from moebit.data import check_path

INTERNAL_FIELDS = ("extra", "resume")  # not flags: set through a config file / --resume RUN


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="moebit train", argument_default=argparse.SUPPRESS, allow_abbrev=False,
        description="Train a byte-level LM on N ranks (launched through torch.distributed.run).",
    )
    add_launch_flags(ap)
    ap.add_argument("--config", help="TOML or JSON file with the same settings as the flags")
    ap.add_argument("--resume", metavar="RUN",
                    help="continue RUN from its newest checkpoint (its config; flags override)")
    add_config_flags(ap, skip=INTERNAL_FIELDS)
    return ap


def parse_train_args(argv: list[str]) -> tuple[TrainConfig, dict[str, Any]]:
    ns, unknown = parse_known(parser(), argv, "train")
    if unknown:
        raise unknown_flag_error(unknown, "train")
    given = vars(ns)
    launch = pop_launch(given)
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


def launch_training(cfg: TrainConfig, launch: dict[str, Any]) -> Path:
    """Run the ranks through torch.distributed.run; returns the run folder."""
    check_path(cfg.data)  # before anything is written or launched
    tracking.require(cfg)
    run_dir = prepare_run_dir(cfg)
    print_run_folder(run_dir, "train")
    run_ranks(launch, "moebit.train", ["--resolved-config", str(run_dir / "config.json")],
              "training", f"Resume with: moebit train --resume {run_dir}")
    return run_dir


def main(argv: list[str]) -> int:
    cfg, launch = parse_train_args(argv)
    run_dir = launch_training(cfg, launch)
    print(f"moebit: done; metrics and plots in {run_dir}")
    return 0
