"""Where a teacher comes from, for every model family: a moebit run (its newest complete
checkpoint) or a model folder (a Hugging Face folder); and the student's starting folder
for families whose students train ``--init-from`` a folder.

    t = find_teacher("runs/a")            # or "hf/mixtral"
    teacher = load_teacher(t, ep_size=2, rank=r)    # frozen, eval mode, this rank's experts
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from moebit.checkpoint import latest, read_manifest
from moebit.distill.students import DistillError, init_student_, student_config
from moebit.inference.loading import load_model, model_config_of
from moebit.models.family import ModelFamily
from moebit.models.interface import CausalLM
from moebit.models.registry import family_of, family_of_folder


@dataclasses.dataclass(frozen=True)
class Teacher:
    source: Path  # what --teacher named
    checkpoint: Path | None  # the run's newest complete checkpoint; None for a folder
    config: Any  # its family's model config
    family: ModelFamily
    folder: Path | None  # the model folder holding its tokenizer files (None: none)
    train_values: dict[str, Any]  # the run's training settings (empty for a folder)

    @property
    def step(self) -> int:
        """The step of the teacher's checkpoint (0 for a folder)."""
        return int(read_manifest(self.checkpoint)["step"]) if self.checkpoint is not None else 0


def find_teacher(source: str | Path) -> Teacher:
    """The teacher ``source`` names; a missing or unusable folder is a DistillError naming it."""
    p = Path(source)
    if not p.exists():
        raise DistillError(f"--teacher {str(p)!r} does not exist (a model folder or a moebit "
                           "run folder)")
    if not p.is_dir():
        raise DistillError(f"--teacher {str(p)!r} is a file, not a model or run folder")
    fam = family_of_folder(p)
    if fam is not None:
        return Teacher(p, None, fam.read_folder_config(p), fam, p, {})
    if not (p / "config.json").is_file():
        raise DistillError(f"--teacher {str(p)!r}: not a run folder (no config.json)")
    if not (p / "checkpoints").is_dir():
        raise DistillError(f"--teacher {str(p)!r} has a config.json but neither safetensors "
                           "weights (model.safetensors / model.safetensors.index.json) nor "
                           "checkpoints/: not a Hugging Face folder nor a trained run")
    ckpt = latest(p)
    if ckpt is None:
        raise DistillError(f"--teacher {str(p)!r}: the run has no complete checkpoint")
    cfg = model_config_of(read_manifest(ckpt), ckpt)
    values = dict(read_manifest(ckpt).get("config") or {})
    init = values.get("init_from")
    return Teacher(p, ckpt, cfg, family_of(cfg), Path(init) if init else None, values)


def load_teacher(t: Teacher, ep_size: int = 1, rank: int = 0,
                 dtype: torch.dtype | None = None) -> CausalLM:
    """The teacher, its experts split over ``ep_size`` ranks (this rank's slice), frozen."""
    ep = ep_size if t.family.pattern(t.config).is_moe else 1
    if t.checkpoint is None:
        assert t.folder is not None
        model = t.family.load_folder(t.family.with_ep_size(t.config, ep), t.folder, dtype)
    else:
        model = load_model(t.checkpoint, ep_size=ep, rank=rank, dtype=dtype)
    model.requires_grad_(False)  # type: ignore[attr-defined]
    return model.eval()  # type: ignore[attr-defined]


@torch.no_grad()
def write_student(teacher: CausalLM, keep: list[int], out: str | Path) -> CausalLM:
    """Build the student of ``teacher`` (one process, no expert parallelism), copy the kept
    layers and everything outside the layers, and save it as its family's model folder."""
    fam = family_of(teacher.config)
    cfg = student_config(fam.with_ep_size(teacher.config, 1), keep)
    dtype = next(teacher.parameters()).dtype  # type: ignore[attr-defined]
    student = fam.build(cfg, dtype=dtype)
    init_student_(student, teacher, keep)  # type: ignore[arg-type]
    fam.save_folder(student, Path(out))
    return student.eval()  # type: ignore[attr-defined]
