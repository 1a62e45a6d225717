"""``moebit distill``: Mixture-of-Students from a trained teacher run.

    moebit distill --teacher runs/prmoe --student-layers 6 --steps 300 --run-dir runs/mos
    moebit distill --teacher runs/prmoe --student-layers 6 --no-kd --run-dir runs/nokd  # baseline
    moebit distill --resume runs/mos                     # continue from the newest checkpoint
    moebit report runs/prmoe runs/mos runs/nokd
    moebit distill --teacher path/to/qwen3-moe --student-layers 12 --data corpus/ \
        --block-size 512 --nproc 2 --ep-size 2 --run-dir runs/qwen-mos   # a Hugging Face teacher

The student takes the teacher's configuration (widths, experts, MoE settings, data,
optimizer, schedule) with fewer blocks; training flags override the teacher's values,
model-shape flags are refused. ``--resume RUN`` takes the settings of RUN (config.json and
distill.json; training flags override them) and continues in the KD stage it was in. Ranks
are launched through torch.distributed.run exactly as ``moebit train`` launches them, each
running ``python -m moebit.distill.run``.

A Hugging Face teacher (a folder, or a run trained ``--init-from`` one): the student's
starting folder ``RUN/student-init`` (its config.json with fewer layers, the kept layers'
weights, the teacher's tokenizer files) is written here, in this process, before any rank
starts; the student then trains ``--init-from`` it. ``--block-size`` is its sequence length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from moebit.checkpoint import write_text_atomic
from moebit.cli.args import UsageError, add_config_flags, parse_known, unknown_flag_error
from moebit.cli.launch import (
    add_launch_flags,
    pop_launch,
    prepare_run_dir,
    print_run_folder,
    release_run_dir,
    run_ranks,
)
from moebit.cli.train import INTERNAL_FIELDS
from moebit.cli.validate import check_run
from moebit.distill.run import (
    DISTILL_FILE,
    FIXED_BY_TEACHER,
    DistillConfig,
    load_teacher_config,
    student_train_config,
)
from moebit.distill.students import check_keep, choose_layers
from moebit.distill.teacher import Teacher, find_teacher, load_teacher, write_student
from moebit.models.hf.folder import (
    check_folder,
    check_training_tokenizer,
    copy_side_files,
    looks_like_hf_folder,
)
from moebit.runs import tracking
from moebit.runs.metrics import FILE_NAME as METRICS_FILE
from moebit.training.config import TrainConfig, build

STUDENT_DIR = "student-init"  # the Hugging Face student's starting folder, inside the run


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="moebit distill", argument_default=argparse.SUPPRESS, allow_abbrev=False,
        description="Distil a teacher run into a shallower student (Mixture-of-Students).",
    )
    kd = ap.add_argument_group("distillation")
    ap.add_argument("--resume", metavar="RUN",
                    help="continue the distillation RUN from its newest checkpoint (its settings; "
                         "training flags override them)")
    kd.add_argument("--teacher", metavar="RUN|HF_DIR",
                    help="the teacher: a run folder, or a Hugging Face model folder (required)")
    kd.add_argument("--student-layers", type=int, help="blocks of the student (required)")
    kd.add_argument("--keep-layers", metavar="I,J,...",
                    help="teacher block for each student block (default: keep relative depth, "
                         "see docs/distillation.md)")
    kd.add_argument("--kd-weight", type=float, help="weight of the KD term (default 1.0)")
    kd.add_argument("--temperature", type=float, help="softmax temperature T (default 1.0)")
    kd.add_argument("--kd-stop-fraction", type=float,
                    help="KD for at most this fraction of the steps, then LM loss only (default 0.5)")
    kd.add_argument("--kd-stop", dest="kd_stop_rule", choices=("fraction", "catch-up"),
                    help="catch-up: KD stops as soon as the student's validation loss reaches "
                         "the teacher's, or at --kd-stop-fraction (default); fraction: only there")
    kd.add_argument("--kd-check-every", type=int,
                    help="steps between catch-up checks (one validation pass each; default 10)")
    kd.add_argument("--no-kd", action="store_true", help="baseline: same init and steps, no KD")
    kd.add_argument("--teacher-dtype", choices=("bf16", "fp32"),
                    help="autocast dtype of the teacher's forward pass (default bf16)")
    add_launch_flags(ap)
    # Every other setting defaults to the teacher's; model shapes cannot change (but a
    # Hugging Face student's --block-size, its sequence length, may: refused for a GPT later).
    # --init-from is --teacher's job (a Hugging Face student's init_from is RUN/student-init).
    add_config_flags(ap, skip=(*INTERNAL_FIELDS, "init_from",
                               *(k for k in FIXED_BY_TEACHER if k != "block_size")))
    return ap


def _keep_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--keep-layers {text!r}: expected comma-separated block numbers") from None


DISTILL_FLAGS = ("teacher", "student_layers", "keep_layers", "kd_weight", "temperature",
                 "kd_stop_fraction", "kd_stop_rule", "kd_check_every", "no_kd", "teacher_dtype")


def parse_args(argv: list[str]) -> tuple[TrainConfig, DistillConfig, dict[str, Any]]:
    ap = _parser()
    ns, unknown = parse_known(ap, argv, "distill")
    if unknown:
        fixed = {"--" + k.replace("_", "-") for k in FIXED_BY_TEACHER}
        flag = unknown[0].split("=")[0]
        if flag in fixed:
            raise UsageError(f"{flag} cannot be set for a student: model shapes come from the "
                             "teacher (choose depth with --student-layers / --keep-layers)")
        raise unknown_flag_error(unknown, "distill")
    given = vars(ns)
    launch = pop_launch(given)
    dvals = {k: given.pop(k) for k in DISTILL_FLAGS if k in given}
    if "resume" in given:
        cfg, dcfg = _resumed(Path(given.pop("resume")), dvals, given)
        return cfg, dcfg, launch
    for k in ("teacher", "student_layers"):
        if k not in dvals:
            raise UsageError(f"--{k.replace('_', '-')} is required (or --resume RUN)")
    if "keep_layers" in dvals:
        dvals["keep_layers"] = _keep_list(dvals["keep_layers"])
    dcfg = DistillConfig(**dvals).validate()
    if looks_like_hf_folder(dcfg.teacher):  # a corrupt folder: one line naming the file
        check_folder(dcfg.teacher, tokenizer="ignore")  # the tokenizer: in folder_student
    teacher = find_teacher(dcfg.teacher)
    if teacher.folder is not None:  # its student starts from a model folder of its own
        return folder_student(teacher, dcfg, given), dcfg, launch
    t_cfg, _ = load_teacher_config(dcfg.teacher)
    cfg, keep = student_train_config(t_cfg, dcfg, given)
    dcfg.keep_layers = keep
    if cfg.run_dir is None:
        cfg.run_dir = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-distill"
    return cfg, dcfg, launch


def folder_student(t: Teacher, dcfg: DistillConfig, given: dict[str, Any]) -> TrainConfig:
    """The student of a teacher that comes with a model folder (a Hugging Face folder, or
    a run trained ``--init-from`` one): write ``RUN/student-init`` (the kept layers as its
    family's folder, with the teacher's tokenizer) and train ``--init-from`` it.

    Training settings are a teacher run's (none for a folder), then the flags. The folder is
    written before the launch checks, since the student's config is read from it; a run
    folder that already holds a run is refused first, so nothing of a run is overwritten.
    """
    keep = dcfg.keep_layers or choose_layers(t.config, dcfg.student_layers)
    if len(keep) != dcfg.student_layers:
        raise UsageError(f"--keep-layers lists {len(keep)} layers but --student-layers is "
                         f"{dcfg.student_layers}")
    check_keep(t.config, keep)
    run_dir = Path(given.pop("run_dir", None) or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-distill")
    if (run_dir / METRICS_FILE).exists():
        raise UsageError(f"--run-dir {str(run_dir)!r} already holds a run ({METRICS_FILE}): pick "
                         f"another folder, or continue it with --resume {run_dir}")
    if t.folder is not None:  # the student trains on its ids: checked before writing
        check_training_tokenizer(t.folder, t.config.vocab_size)
    student_dir = run_dir / STUDENT_DIR
    teacher = load_teacher(t, dtype=t.family.stored_dtype(t.config) if t.checkpoint is None else None)
    write_student(teacher, keep, student_dir)
    del teacher
    if t.folder is not None and t.folder.is_dir():  # tokenizer, chat template, ...
        copy_side_files(t.folder, student_dir)
    values = {**t.train_values, "init_from": str(student_dir), "resume": False,
              "run_dir": str(run_dir)}
    dcfg.keep_layers = keep
    return build(values, given, source=f"{t.source} (teacher) + flags")


def _resumed(run: Path, dvals: dict[str, Any], given: dict[str, Any]
             ) -> tuple[TrainConfig, DistillConfig]:
    """The settings of the distillation ``run`` to continue, training flags applied."""
    if dvals:
        key = next(iter(dvals))
        flag = "--kd-stop" if key == "kd_stop_rule" else "--" + key.replace("_", "-")
        raise UsageError(f"--resume RUN takes the distillation settings from RUN/{DISTILL_FILE}; "
                         f"drop {flag}")
    for name in ("config.json", DISTILL_FILE):
        if not (run / name).is_file():
            raise UsageError(f"--resume {str(run)!r}: not a distillation run folder (no {name})")
    given.pop("run_dir", None)
    values = {**json.loads((run / "config.json").read_text()), "resume": True, "run_dir": str(run)}
    cfg = build(values, given, source=f"{run}/config.json")
    dcfg = DistillConfig.from_dict(json.loads((run / DISTILL_FILE).read_text()))
    return cfg, dcfg


def launch_distill(cfg: TrainConfig, dcfg: DistillConfig, launch: dict[str, Any]) -> Path:
    """Check, take the run folder, run the ranks through torch.distributed.run."""
    tracking.require(cfg)  # before the run folder is written
    corpus = check_run(cfg, launch)
    if corpus is not None:
        print(f"moebit distill: {corpus.summary()}", file=sys.stderr)
    run_dir = prepare_run_dir(cfg, "distill", int(launch.get("node_rank", 0)))
    try:
        write_text_atomic(json.dumps(dcfg.to_dict(), indent=2) + "\n", run_dir / DISTILL_FILE)
        print_run_folder(run_dir, "distill", f"; student blocks from teacher blocks {dcfg.keep_layers}")
        run_ranks(launch, "moebit.distill.run", ["--resolved-config", str(run_dir / "config.json")],
                  "distillation", f"Resume with: moebit distill --resume {run_dir}", run_dir=run_dir)
    finally:
        release_run_dir(run_dir)
    return run_dir


def compare_command(teacher: str | Path, run_dir: Path) -> str:
    """The command that compares the student with its teacher: ``moebit report`` reads
    run folders, so a Hugging Face folder teacher (no metrics.jsonl) is left out of it."""
    if (Path(teacher) / METRICS_FILE).is_file():
        return f"moebit report {teacher} {run_dir}"
    return f"moebit report {run_dir}; moebit eval {run_dir}"


def main(argv: list[str]) -> int:
    cfg, dcfg, launch = parse_args(list(argv))
    run_dir = launch_distill(cfg, dcfg, launch)
    print(f"moebit distill: done; metrics and plots in {run_dir} "
          f"(compare: {compare_command(dcfg.teacher, run_dir)})")
    return 0
