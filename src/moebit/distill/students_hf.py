"""Mixture-of-Students for the Hugging Face families: the shallower student of a Mixtral,
Qwen2-MoE, Qwen3-MoE or OLMoE teacher.

The student is the teacher's own ``config.json`` with fewer decoder layers. Which teacher
layers it keeps follows the GPT rule (``moebit.distill.students.keep_by_depth``: relative depth,
first and last layer kept) under the family's MoE/dense pattern: the student follows the
teacher's pattern rule (``decoder_sparse_step``, ``first_k_dense_replace``) at its own
depth, a dense slot taking a dense teacher layer and an MoE slot an MoE layer, or one of
the teacher's ``mlp_only_layers`` (dense by exception), which then becomes one of the
student's ``mlp_only_layers``. The
student's ``config.json`` is rewritten accordingly (``num_hidden_layers``,
``mlp_only_layers``, ``layer_types``), so it never carries the teacher's depth, and the
moebit decoder it describes has an MoE layer exactly where its kept teacher layer had one.

A teacher is a Hugging Face folder or a moebit run trained ``--init-from`` one (its newest
checkpoint). ``write_student`` materialises the student's starting point as a Hugging Face
folder; the student run then trains ``--init-from`` that folder, on the teacher's
tokenizer ids, exactly as ``moebit train --init-from`` does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moebit.checkpoint import latest, read_manifest
from moebit.distill.students import DistillError, init_student_, keep_by_depth
from moebit.inference.loading import load_model, model_config_of
from moebit.models.hf import (
    HFDecoder,
    HFDecoderConfig,
    build_empty,
    from_pretrained,
    is_hf_folder,
    read_config,
    save_pretrained,
)

# HFDecoderConfig fields a student may differ in from its teacher (depth and its pattern,
# the source dict, and the run's own sequence length and expert parallelism)
_FREE_FIELDS = ("num_layers", "moe_layers", "hf", "ep_size", "block_size")


@dataclasses.dataclass(frozen=True)
class HFTeacher:
    """Where a Hugging Face teacher comes from: a folder, or a run's checkpoint."""

    source: Path  # what --teacher named
    checkpoint: Path | None  # the run's newest complete checkpoint; None for a folder
    config: HFDecoderConfig
    init_from: Path | None  # the folder holding its tokenizer files (None: unknown)
    train_values: dict[str, Any]  # the run's training settings (empty for a folder)


def find_hf_teacher(source: str | Path) -> HFTeacher | None:
    """The Hugging Face teacher ``source`` names, or None when it is a moebit GPT run;
    a missing or unusable folder is a DistillError naming it."""
    p = Path(source)
    if not p.exists():
        raise DistillError(f"--teacher {str(p)!r} does not exist (a Hugging Face model folder "
                           "or a moebit run folder)")
    if not p.is_dir():
        raise DistillError(f"--teacher {str(p)!r} is a file, not a model or run folder")
    if is_hf_folder(p):
        return HFTeacher(p, None, read_config(p), p, {})
    if (p / "config.json").is_file() and not (p / "checkpoints").is_dir():
        raise DistillError(f"--teacher {str(p)!r} has a config.json but neither safetensors "
                           "weights (model.safetensors / model.safetensors.index.json) nor "
                           "checkpoints/: not a Hugging Face folder nor a trained run")
    ckpt = latest(p)
    if ckpt is None:
        return None  # the GPT path reports a run without checkpoints
    manifest = read_manifest(ckpt)
    if "model_type" not in (manifest.get("model_config") or {}):
        return None  # a moebit GPT run
    cfg = model_config_of(manifest, ckpt)
    assert isinstance(cfg, HFDecoderConfig)
    values = dict(manifest.get("config") or {})
    init = values.get("init_from")
    return HFTeacher(p, ckpt, cfg, Path(init) if init else None, values)


def rule_is_moe(teacher: HFDecoderConfig, n_layers: int) -> list[bool]:
    """The family's regular pattern at depth ``n_layers``: every ``decoder_sparse_step``-th
    layer from ``first_k_dense_replace`` on is MoE (before ``mlp_only_layers``)."""
    step = int(teacher.hf.get("decoder_sparse_step", 1) or 1)
    first = int(teacher.hf.get("first_k_dense_replace", 0) or 0)
    return [teacher.num_experts > 0 and (i + 1) % step == 0 and i >= first
            for i in range(n_layers)]


def _fits(teacher: HFDecoderConfig, n_student: int) -> Any:
    """fits(i, j): teacher layer j may initialise student layer i. Kinds match, or j is one
    of the teacher's ``mlp_only_layers`` (dense where the rule says MoE) and fills a slot
    the rule makes MoE, becoming one of the student's ``mlp_only_layers``."""
    t_moe = [j in teacher.moe_layers for j in range(teacher.num_layers)]
    t_rule = rule_is_moe(teacher, teacher.num_layers)
    s_rule = rule_is_moe(teacher, n_student)
    mlp_only = [t_rule[j] and not t_moe[j] for j in range(teacher.num_layers)]
    return lambda i, j: t_moe[j] == s_rule[i] or (s_rule[i] and mlp_only[j])


def choose_hf_layers(teacher: HFDecoderConfig, n_student: int) -> list[int]:
    """The teacher layer that initialises each of the ``n_student`` student layers."""
    T = teacher.num_layers
    if not 1 <= n_student < T:
        raise DistillError(f"--student-layers must be in [1, {T - 1}]: the student must be "
                           f"shallower than the teacher ({T} layers), got {n_student}")
    return keep_by_depth(T, n_student, _fits(teacher, n_student))


def check_hf_keep(teacher: HFDecoderConfig, keep: list[int]) -> None:
    """``keep`` is increasing, in range, shallower than the teacher, and fits the pattern."""
    T, L = teacher.num_layers, len(keep)
    if not 1 <= L < T:
        raise DistillError(f"--keep-layers {keep}: a student needs 1 to {T - 1} layers "
                           f"(the teacher has {T})")
    bad = [k for k in keep if not 0 <= k < T]
    if bad:
        raise DistillError(f"--keep-layers {keep}: layers {bad} do not exist (the teacher has {T})")
    if any(b <= a for a, b in zip(keep, keep[1:], strict=False)):
        raise DistillError(f"--keep-layers {keep}: must be strictly increasing (layers keep their order)")
    fits, rule = _fits(teacher, L), rule_is_moe(teacher, L)
    for i, k in enumerate(keep):
        if not fits(i, k):
            raise DistillError(
                f"--keep-layers {keep}: student layer {i} is an MoE layer by the family's pattern "
                f"but teacher layer {k} is dense" if rule[i] else
                f"--keep-layers {keep}: student layer {i} is dense by the family's pattern "
                f"(decoder_sparse_step / first_k_dense_replace) but teacher layer {k} is MoE")


def student_hf_dict(teacher: HFDecoderConfig, keep: list[int]) -> dict[str, Any]:
    """The student's ``config.json``: the teacher's with ``num_hidden_layers``, the
    per-layer lists and ``mlp_only_layers`` rewritten for the kept layers."""
    check_hf_keep(teacher, keep)
    out = dict(teacher.hf)
    out["num_hidden_layers"] = len(keep)
    for key in ("layer_types",):  # per-layer lists follow their layers
        if isinstance(out.get(key), list):
            out[key] = [out[key][k] for k in keep]
    rule = rule_is_moe(teacher, len(keep))
    dense = [i for i, k in enumerate(keep) if rule[i] and k not in teacher.moe_layers]
    if "mlp_only_layers" in out or dense:
        out["mlp_only_layers"] = dense
    if "max_window_layers" in out:  # Qwen: layers below it would use a sliding window
        out["max_window_layers"] = min(int(out["max_window_layers"]), len(keep))
    return out


def student_hf_config(teacher: HFDecoderConfig, keep: list[int]) -> HFDecoderConfig:
    """The student's decoder config (read back from its ``config.json`` as moebit reads it)."""
    cfg = HFDecoderConfig.from_hf(student_hf_dict(teacher, keep), ep_size=teacher.ep_size)
    check_hf_compatible(teacher, cfg, keep)
    return cfg


def check_hf_compatible(teacher: HFDecoderConfig, student: HFDecoderConfig, keep: list[int]) -> None:
    """Raise DistillError naming the first way ``student`` cannot start from ``teacher``."""
    t, s = dataclasses.asdict(teacher), dataclasses.asdict(student)
    for key in t:
        if key not in _FREE_FIELDS and t[key] != s[key]:
            raise DistillError(f"teacher and student differ in {key} (teacher {t[key]!r}, "
                               f"student {s[key]!r}): the student starts from the teacher's weights")
    if len(keep) != student.num_layers:
        raise DistillError(f"{len(keep)} kept teacher layers for a {student.num_layers}-layer student")
    for i, k in enumerate(keep):
        if (i in student.moe_layers) != (k in teacher.moe_layers):
            raise DistillError(f"student layer {i} is {'MoE' if i in student.moe_layers else 'dense'} "
                               f"but teacher layer {k}, which initialises it, is not")


def load_hf_teacher(teacher: HFTeacher, ep_size: int = 1, rank: int = 0,
                    dtype: torch.dtype | str | None = None) -> HFDecoder:
    """The teacher, its experts split over ``ep_size`` ranks (this rank's slice), frozen."""
    if teacher.checkpoint is None:
        model = from_pretrained(teacher.source, ep_size=ep_size if teacher.config.is_moe else 1,
                                rank=rank, dtype=dtype)
    else:
        model = load_model(teacher.checkpoint, ep_size=ep_size if teacher.config.is_moe else 1,
                           rank=rank, dtype=dtype if isinstance(dtype, torch.dtype) else None)
    assert isinstance(model, HFDecoder)
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def write_student(teacher: nn.Module, keep: list[int], out: str | Path) -> HFDecoder:
    """Build the student of ``teacher`` (one process, no expert parallelism), copy the kept
    layers, embeddings, final norm and head, and save it as a Hugging Face folder."""
    cfg = student_hf_config(teacher.config.replace(ep_size=1), keep)
    student = build_empty(cfg, teacher.wte.weight.dtype)
    init_student_(student, teacher, keep)
    save_pretrained(student, out)
    return student.eval()
