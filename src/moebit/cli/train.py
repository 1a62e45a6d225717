"""``moebit train``: resolve the settings (defaults, a file, flags), then launch the ranks.

    moebit train --nproc 2 --steps 300                 # 2 ranks on this machine
    moebit train --config run.toml --lr 3e-4           # a file, flags override it
    moebit train --resume runs/a                       # continue from the newest checkpoint
    moebit train --resume runs/a/checkpoints/step-00000200   # ... or from this one
    moebit train --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 ...   # multi-node
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moebit.checkpoint import MANIFEST, latest, write_text_atomic
from moebit.cli.args import RunStopped, UsageError, add_config_flags, parse_known, unknown_flag_error
from moebit.cli.launch import (
    add_launch_flags,
    pop_launch,
    prepare_run_dir,
    print_run_folder,
    release_run_dir,
    run_ranks,
    set_aside_newer,
)
from moebit.cli.validate import check_outer_resume, check_resume, check_run, world_of
from moebit.runs import tracking
from moebit.training.config import TrainConfig, build, load_file

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


def resume_target(path: str) -> tuple[Path, Path | None]:
    """``--resume RUN`` or ``--resume RUN/checkpoints/step-N``: (run folder, chosen checkpoint)."""
    p = Path(path)
    if p.parent.name == "checkpoints" and p.name.startswith("step-"):
        if not (p / MANIFEST).is_file():
            raise UsageError(f"--resume {path!r}: not a complete checkpoint (no {MANIFEST})")
        return p.parent.parent, p
    return p, None


def parse_train_args(argv: list[str]) -> tuple[TrainConfig, dict[str, Any]]:
    """The config and the launch flags; a resume's chosen checkpoint is ``launch["resume_from"]``."""
    ns, unknown = parse_known(parser(), argv, "train")
    if unknown:
        raise unknown_flag_error(unknown, "train")
    given = vars(ns)
    launch = pop_launch(given)
    if "resume" in given:
        run, chosen = resume_target(given.pop("resume"))
        if "config" in given:
            raise UsageError("--resume RUN takes its settings from RUN/config.json; drop --config")
        if not (run / "config.json").is_file():
            raise UsageError(f"--resume {str(run)!r}: not a run folder (no config.json)")
        try:
            file_values = json.loads((run / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"{run}/config.json is not valid JSON: {e}") from None
        file_values.update(resume=True, run_dir=str(run))
        given.pop("run_dir", None)
        launch["resume_from"] = chosen
        return build(file_values, given, source=f"{run}/config.json"), launch
    file_values = load_file(given.pop("config")) if "config" in given else {}
    cfg = build(file_values, given, source=str(file_values and "--config file"))
    return cfg, launch


def check_training(cfg: TrainConfig, launch: dict[str, Any]) -> Path | None:
    """Every check that can run before a rank starts or a file is written; returns the
    checkpoint a resume will load."""
    tracking.require(cfg)
    corpus = check_run(cfg, launch)
    if corpus is not None:
        print(f"moebit train: {corpus.summary()}", file=sys.stderr)
    if cfg.resume:
        d = check_resume(Path(str(cfg.run_dir)), cfg, launch.get("resume_from"))
        check_outer_resume(d, cfg, world_of(launch))
        return d
    return None


def launch_training(cfg: TrainConfig, launch: dict[str, Any]) -> Path:
    """Check, take the run folder, run the ranks through torch.distributed.run; returns the
    run folder."""
    ckpt = check_training(cfg, launch)
    config = Path(str(cfg.run_dir)) / "config.json"
    previous = config.read_text() if ckpt is not None else None
    run_dir = prepare_run_dir(cfg, "train", int(launch.get("node_rank", 0)),
                              int(launch.get("nnodes", 1)))
    try:
        if ckpt is not None and launch.get("resume_from") is not None:
            for d in set_aside_newer(run_dir, ckpt):
                print(f"moebit train: resuming from {ckpt}; set aside the newer {d}", file=sys.stderr)
        print_run_folder(run_dir, "train")
        run_ranks({k: v for k, v in launch.items() if k != "resume_from"}, "moebit.training.loop",
                  ["--resolved-config", str(config)], "training",
                  f"Resume with: moebit train --resume {run_dir}", run_dir=run_dir)
    except (RuntimeError, RunStopped):
        if previous is not None and latest(run_dir) == ckpt:
            # The resume failed before it saved anything: its overrides are not the run's.
            write_text_atomic(previous, config)
        raise
    finally:
        release_run_dir(run_dir)
    return run_dir


def main(argv: list[str]) -> int:
    cfg, launch = parse_train_args(argv)
    run_dir = launch_training(cfg, launch)
    print(f"moebit: done; metrics and plots in {run_dir}")
    return 0
