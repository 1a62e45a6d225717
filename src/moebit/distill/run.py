"""Mixture-of-Students: staged knowledge distillation of a (PR-)MoE teacher into a shallower student.

The student is the teacher's own configuration with fewer blocks, initialised block by
block from the teacher (``choose_layers`` says which blocks and why). It trains on

    loss = LM loss + aux loss + kd_weight * T^2 * KL(teacher_T || student_T)   (per token)

until its validation loss reaches the teacher's (checked every ``kd_check_every`` steps)
or ``kd_stop_fraction`` of its steps have run, then on LM + aux loss alone (staged KD: a
smaller student cannot match the teacher's whole distribution, and once it predicts
held-out text as well as the teacher, imitation only pulls it back toward the teacher's
errors; the DeepSpeed-MoE paper also stops KD part way). ``kd_stop_rule="fraction"``
stops at the fraction only.
The teacher runs in eval mode without gradients, under bf16 autocast by default, built
with the student's ``ep_size`` so its experts are sharded over the ranks exactly as in
training; after the switch it is no longer run at all.

Distillation is the training loop (``moebit.training.loop.train``) plus a KD stage passed as its
hooks (``KDStage``): the teacher's forward and the KD term, the stop rule, and the stage's
state, saved in every checkpoint. So it has everything training has: ``--resume``,
``--save-every``, ``--max-restarts`` that resume, ``--on-nan``, the freeze record and the
gradient metrics. The student itself (which blocks, its init, the KD loss) is
``moebit.distill.students``, one algorithm for every model family; a teacher that comes
with a model folder (a Hugging Face folder, or a run trained ``--init-from`` one) gets a
student folder, ``RUN/student-init``, which the student trains ``--init-from``.

Each rank runs ``python -m moebit.distill.run --resolved-config RUN/config.json``, launched
by ``moebit distill`` (``moebit.cli.distill``); ``RUN/distill.json`` holds the settings
below. The run folder is an ordinary moebit run (same metrics records as ``moebit train``,
plus ``kd_loss`` on train records and a ``kd_stop`` record), so ``moebit report`` and
``moebit generate`` work on it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moebit.checkpoint import latest
from moebit.comm.collectives import DistInfo
from moebit.distill.students import (
    DistillError,
    block_experts,
    check_compatible,
    check_keep,
    choose_layers,
    init_student_,
    kd_loss,
    student_config,
)
from moebit.distill.teacher import find_teacher, load_teacher
from moebit.models.interface import ModelOutput
from moebit.training.config import TrainConfig, build
from moebit.training.evaluation import autocast, evaluate
from moebit.training.hooks import Batch, Hooks, Loop
from moebit.training.loop import print_summary, train
from moebit.training.loop import run as run_training

# The student's parts are re-exported: ``moebit.distill.run`` is where users look for them.
__all__ = ["DISTILL_FILE", "DistillConfig", "DistillError", "KDStage", "block_experts",
           "check_compatible", "check_keep", "choose_layers", "distill", "init_student_",
           "kd_loss", "student_config", "student_train_config"]

DISTILL_FILE = "distill.json"


@dataclass
class DistillConfig:
    # the teacher's run folder (its newest complete checkpoint is used) or Hugging Face folder
    teacher: str
    student_layers: int
    keep_layers: list[int] | None = None  # teacher block for each student block; None: choose_layers
    kd_weight: float = 1.0
    temperature: float = 1.0
    kd_stop_fraction: float = 0.5  # KD on for the first round(fraction * steps) steps at most
    # "catch-up": also stop at the first check (every kd_check_every steps) where the
    # student's validation loss is <= the teacher's; "fraction": stop exactly at the fraction
    kd_stop_rule: str = "catch-up"
    kd_check_every: int = 10
    no_kd: bool = False  # baseline: the same init and steps, LM + aux loss only
    teacher_dtype: str = "bf16"  # autocast dtype of the teacher's forward pass

    def validate(self) -> DistillConfig:
        if self.student_layers < 1:
            raise DistillError(f"--student-layers must be >= 1, got {self.student_layers}")
        if self.kd_weight < 0:
            raise DistillError(f"--kd-weight must be >= 0, got {self.kd_weight}")
        if not self.temperature > 0:
            raise DistillError(f"--temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.kd_stop_fraction <= 1.0:
            raise DistillError(f"--kd-stop-fraction must be in [0, 1], got {self.kd_stop_fraction}")
        if self.kd_stop_rule not in ("fraction", "catch-up"):
            raise DistillError(f"--kd-stop must be fraction or catch-up, got {self.kd_stop_rule!r}")
        if self.kd_check_every < 1:
            raise DistillError(f"--kd-check-every must be >= 1, got {self.kd_check_every}")
        if self.teacher_dtype not in ("bf16", "fp32"):
            raise DistillError(f"--teacher-dtype must be bf16 or fp32, got {self.teacher_dtype!r}")
        return self

    def kd_steps(self, steps: int) -> int:
        """How many leading steps use the KD term (0 with ``no_kd``)."""
        return 0 if self.no_kd else min(steps, round(self.kd_stop_fraction * steps))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DistillConfig:
        return cls(**d).validate()


def load_teacher_config(teacher_run: str | Path) -> tuple[TrainConfig, Path]:
    """The teacher's TrainConfig and its newest complete checkpoint folder."""
    run = Path(teacher_run)
    if not (run / "config.json").is_file():
        raise DistillError(f"--teacher {str(run)!r}: not a run folder (no config.json)")
    ckpt = latest(run)
    if ckpt is None:
        raise DistillError(f"--teacher {str(run)!r}: the run has no complete checkpoint")
    cfg = build(json.loads((run / "config.json").read_text()), source=f"{run}/config.json")
    return cfg, ckpt


# Model-shape settings come from the teacher: a student of another width cannot start from it.
FIXED_BY_TEACHER = ("n_layer", "n_head", "d_model", "d_ffn", "block_size", "num_experts",
                    "moe_every", "moe_residual", "num_experts_per_tok")


def student_train_config(teacher: TrainConfig, dcfg: DistillConfig,
                         overrides: dict[str, Any]) -> tuple[TrainConfig, list[int]]:
    """The student's TrainConfig (teacher's, minus layers, plus training overrides)."""
    fixed = sorted(set(overrides) & set(FIXED_BY_TEACHER))
    if fixed:
        raise DistillError(
            f"--{fixed[0].replace('_', '-')} cannot be set for a student: model shapes come from "
            "the teacher (choose depth with --student-layers / --keep-layers)"
        )
    t_model = teacher.model_config()
    keep = dcfg.keep_layers or choose_layers(t_model, dcfg.student_layers)
    if len(keep) != dcfg.student_layers:
        raise DistillError(f"--keep-layers lists {len(keep)} blocks but --student-layers is "
                           f"{dcfg.student_layers}")
    s_model = student_config(t_model, keep)
    values = {**teacher.to_dict(), **overrides, "n_layer": s_model.n_layer,
              "num_experts": s_model.num_experts, "resume": False, "run_dir": None}
    if "run_dir" in overrides:
        values["run_dir"] = overrides["run_dir"]
    cfg = build(values, source="teacher config + flags")
    check_compatible(t_model, cfg.model_config(), keep)
    return cfg, keep


@dataclass
class KDStage:
    """The KD stage of a distillation, as hooks of the training loop.

    KD is on from the first step until the stop rule fires (``before_step``); while it is
    on, ``extra_loss`` runs the teacher and adds ``kd_weight * kd_loss``. ``active``,
    ``used`` and ``teacher_val`` are checkpointed with the run, so a resumed distillation
    continues in the stage it was in, bit for bit.
    """

    dcfg: DistillConfig
    teacher: nn.Module
    teacher_step: int
    keep: list[int]
    kd_steps: int  # KD for at most these leading steps
    active: bool = True
    used: int = 0  # steps that ran with the KD term
    teacher_val: float = math.nan

    @property
    def teacher_dtype(self) -> str:
        return "bf16" if self.dcfg.teacher_dtype == "bf16" else "fp32"

    def start(self, loop: Loop) -> dict[str, Any]:
        """The teacher's and the initial student's validation loss, in the start record."""
        self.teacher_val = evaluate(self.teacher, loop.val_batches, self.teacher_dtype,
                                    loop.info.device)
        d = self.dcfg
        return {"teacher": str(d.teacher), "teacher_step": self.teacher_step,
                "teacher_params": self.teacher.num_params(),
                "teacher_layers": len(self.teacher.blocks), "keep_layers": self.keep,
                "teacher_val_loss": self.teacher_val, "init_val_loss": loop.validate(),
                "kd_steps": self.kd_steps, "kd_stop_rule": d.kd_stop_rule,
                "kd_weight": 0.0 if d.no_kd else d.kd_weight, "temperature": d.temperature}

    def before_step(self, loop: Loop, step: int) -> None:
        """The stop rule: the fraction's last step passed, or (catch-up) the student reached
        the teacher at a check; either writes a ``kd_stop`` record."""
        if not self.active:
            return
        d = self.dcfg
        if step >= self.kd_steps:
            self.active = False
            if self.kd_steps == 0:
                why = "--no-kd" if d.no_kd else f"--kd-stop-fraction {d.kd_stop_fraction}"
                loop.emit({"kind": "kd_stop", "step": step,
                           "reason": f"{why}: LM + aux loss from the start"})
                return
            loop.emit({"kind": "kd_stop", "step": step, "rule": "fraction",
                       "fraction": d.kd_stop_fraction,
                       "reason": f"KD ran for round({d.kd_stop_fraction} * {loop.cfg.steps}) "
                                 "steps; LM + aux loss only from here"})
        elif d.kd_stop_rule == "catch-up" and step and step % d.kd_check_every == 0:
            v = caught_up(loop, self.teacher_val)
            if v is not None:
                self.active = False
                loop.emit({"kind": "kd_stop", "step": step, "rule": "catch-up", "val_loss": v,
                           "teacher_val_loss": self.teacher_val,
                           "reason": "the student's validation loss reached the teacher's: KD "
                                     "can only pull it back; LM + aux loss only from here"})

    def extra_loss(self, batch: Batch, out: ModelOutput
                   ) -> tuple[torch.Tensor, dict[str, float]] | None:
        if not self.active:
            return None  # after the switch the teacher is not run at all
        x, _ = batch
        with torch.no_grad(), autocast(self.teacher_dtype, x.device):
            t_logits = self.teacher(x).logits
        kd = kd_loss(out.logits, t_logits, self.dcfg.temperature)
        self.used += 1
        return self.dcfg.kd_weight * kd, {"kd_loss": float(kd.detach())}

    def evaluated(self, loop: Loop, step: int, val_loss: float) -> dict[str, Any]:
        return {"val_vs_teacher": val_loss / self.teacher_val}

    def end(self, loop: Loop, summary: dict[str, Any]) -> dict[str, Any]:
        return {"kd_steps": self.used, "teacher_val_loss": self.teacher_val,
                "teacher_params": self.teacher.num_params(),
                "val_vs_teacher": summary["val_loss"] / self.teacher_val}

    def state_dict(self) -> dict[str, Any]:
        return {"active": self.active, "used": self.used, "teacher_val": self.teacher_val}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if not d:
            return  # a fresh run
        if set(d) != {"active", "used", "teacher_val"}:
            raise DistillError(f"checkpoint's KD state has keys {sorted(d)}: not a distillation "
                               "run, or one of another moebit version")
        self.active, self.used, self.teacher_val = bool(d["active"]), int(d["used"]), float(d["teacher_val"])

    def hooks(self) -> Hooks:
        return Hooks(label="distill", init_model=lambda m: init_student_(m, self.teacher, self.keep),
                     start=self.start, before_step=self.before_step, extra_loss=self.extra_loss,
                     evaluated=self.evaluated, end=self.end, state_dict=self.state_dict,
                     load_state_dict=self.load_state_dict)


def caught_up(loop: Loop, teacher_val: float) -> float | None:
    """The student's validation loss if it is <= the teacher's, else None.

    Rank 0 decides and broadcasts: the ranks' losses agree only to rounding, and a rank
    that stopped running the teacher while another still ran it would hang the teacher's
    all-to-all.
    """
    v = loop.validate()
    flag = torch.tensor([1.0 if v <= teacher_val else 0.0], device=loop.info.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(flag, src=0)
    return v if flag.item() > 0 else None


def kd_stage(cfg: TrainConfig, dcfg: DistillConfig, info: DistInfo) -> KDStage:
    """Load the teacher (a run's newest checkpoint or a model folder), sharded like the
    student (this rank's experts only), and check the student fits it."""
    t = find_teacher(dcfg.teacher)
    teacher = load_teacher(t, cfg.moe.ep_size if cfg.moe else 1, info.rank).to(info.device)
    keep = dcfg.keep_layers or choose_layers(t.config, dcfg.student_layers)
    check_compatible(teacher.config, cfg.model_config(), keep)
    return KDStage(dcfg, teacher, t.step, keep, dcfg.kd_steps(cfg.steps))


def distill(cfg: TrainConfig, dcfg: DistillConfig, run_dir: Path, info: DistInfo) -> dict[str, Any]:
    """Train the student on this rank: the training loop with the KD stage's hooks."""
    return train(cfg, run_dir, info, kd_stage(cfg, dcfg, info).hooks())


def run(cfg: TrainConfig, dcfg: DistillConfig, run_dir: Path) -> dict[str, Any]:
    return run_training(cfg, run_dir, lambda info: kd_stage(cfg, dcfg, info).hooks())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moebit.distill.run", description=__doc__)
    ap.add_argument("--resolved-config", required=True,
                    help=f"config.json written by `moebit distill` (with {DISTILL_FILE} beside it)")
    args = ap.parse_args(argv)
    path = Path(args.resolved_config)
    cfg = build(json.loads(path.read_text()), source=str(path))
    dcfg = DistillConfig.from_dict(json.loads((path.parent / DISTILL_FILE).read_text()))
    print_summary(run(cfg, dcfg, path.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
