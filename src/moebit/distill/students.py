"""The student of Mixture-of-Students, for every model family: which teacher layers it
keeps, its configuration, its initialisation from the teacher, and the KD loss.

One algorithm over the family seam (``moebit.models.family``): the family says which
teacher layer may start which student layer (its dense/MoE pattern) and how to write the
student's config; choosing, checking and initialising are the same for moebit's GPT and
the Hugging Face families. Pure functions of configurations and models; the training
stage that uses them is ``moebit.distill.run``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebit.models.registry import family_of


class DistillError(ValueError):
    """Teacher and student do not fit together, or a distillation setting is invalid."""


def block_experts(cfg: Any) -> list[int]:
    """Experts per layer (0: dense), the layer 'kind' a kept layer must match."""
    return list(family_of(cfg).pattern(cfg).experts)


def choose_layers(teacher: Any, n_student: int) -> list[int]:
    """The teacher layer that initialises each student layer.

    Rule: keep the teacher's relative depth. Among all increasing choices whose kinds
    fit the student's pattern (an MoE slot takes an MoE layer, a dense slot a dense one,
    so the family's dense/MoE pattern stays valid), take the one minimising
    sum_i |keep[i]/(T-1) - i/(L-1)|. Why: each kept layer then reads a residual stream
    of about the depth it was trained on; the first layer (which reads raw embeddings)
    and, whenever the pattern allows, the last layer (which writes what the final norm and
    the head decode) are kept, and the layers dropped come from the middle, the most
    redundant part of a deep LM (layer-pruning studies find middle layers removable and
    the first and last ones essential). Dropping an (MoE, dense) pair from the middle also
    keeps a pyramid's largest, last MoE layer. With moebit's ``moe_every`` 2, a student of
    odd depth must end on a dense block, so it keeps the teacher's first L blocks.
    """
    fam = family_of(teacher)
    T, L = fam.pattern(teacher).num_layers, n_student
    most = fam.max_student_layers(teacher)
    if not 1 <= L <= most:
        shallower = ": the student must be shallower than the teacher" if most < T else ""
        raise DistillError(f"--student-layers must be in [1, {most}]{shallower} (the teacher has "
                           f"{T} blocks), got {L}")
    return keep_by_depth(T, L, fam.student_fits(teacher, L))


def keep_by_depth(T: int, L: int, fits: Callable[[int, int], bool]) -> list[int]:
    """The increasing ``keep`` (student layer i <- teacher layer keep[i]) minimising
    sum_i |keep[i]/(T-1) - i/(L-1)| among those where ``fits(i, keep[i])`` holds for all i
    (a dynamic program over (student layer, teacher layer)); ties keep the earliest layer."""
    def cost(i: int, j: int) -> float:
        return abs((j / (T - 1) if T > 1 else 0.0) - (i / (L - 1) if L > 1 else 0.0))

    inf = math.inf
    best = [[inf] * T for _ in range(L)]  # best[i][j]: student layers 0..i placed, i on j
    back = [[-1] * T for _ in range(L)]
    for j in range(T):
        if fits(0, j):
            best[0][j] = cost(0, j)
    for i in range(1, L):
        run_min, run_arg = inf, -1
        for j in range(T):
            if j > 0 and best[i - 1][j - 1] < run_min:  # strict '<': ties keep the earliest
                run_min, run_arg = best[i - 1][j - 1], j - 1
            if fits(i, j) and run_min < inf:
                best[i][j] = run_min + cost(i, j)
                back[i][j] = run_arg
    end = min(range(T), key=lambda j: best[L - 1][j])
    if best[L - 1][end] == inf:
        raise DistillError(f"no {L}-layer student fits the teacher's dense/MoE pattern")
    keep = [end]
    for i in range(L - 1, 0, -1):
        keep.append(back[i][keep[-1]])
    return keep[::-1]


def check_keep(teacher: Any, keep: list[int]) -> None:
    """``keep`` is increasing, in range, not deeper than the family allows, and fits the
    student's dense/MoE pattern."""
    fam = family_of(teacher)
    T, most = fam.pattern(teacher).num_layers, fam.max_student_layers(teacher)
    if not keep:
        raise DistillError("the student needs at least one block (--keep-layers is empty)")
    bad = [k for k in keep if not 0 <= k < T]
    if bad:
        raise DistillError(f"--keep-layers {keep}: blocks {bad} do not exist (the teacher has {T})")
    if any(b <= a for a, b in zip(keep, keep[1:], strict=False)):
        raise DistillError(f"--keep-layers {keep}: must be strictly increasing (blocks keep their order)")
    if len(keep) > most:
        raise DistillError(f"--keep-layers {keep}: a student has at most {most} layers "
                           f"(the teacher has {T})")
    fits = fam.student_fits(teacher, len(keep))
    for i, k in enumerate(keep):
        if not fits(i, k):
            raise DistillError(fam.misfit(teacher, keep, i, k))


def student_config(teacher: Any, keep: list[int]) -> Any:
    """The teacher's configuration with only the ``keep`` layers, as its family writes it."""
    check_keep(teacher, keep)
    return family_of(teacher).student_config(teacher, keep)


def check_compatible(teacher: Any, student: Any, keep: list[int]) -> None:
    """Raise DistillError naming the first way ``student`` cannot be made from ``teacher``."""
    fam, s_fam = family_of(teacher), family_of(student)
    if fam.name != s_fam.name:
        raise DistillError(f"the teacher is a {fam.name} model but the student a {s_fam.name} "
                           "model: the student starts from the teacher's weights")
    t_shape, s_shape = fam.student_shape(teacher), fam.student_shape(student)
    for key in t_shape.keys() & s_shape.keys():
        t, s = t_shape[key], s_shape[key]
        if t != s:
            raise DistillError(
                f"teacher and student differ in {key} (teacher {t!r}, student {s!r}): the student "
                f"is initialised from the teacher's weights and matches its logits, so {key} must match"
            )
    s_pattern, t_pattern = fam.pattern(student), fam.pattern(teacher)
    if len(keep) != s_pattern.num_layers:
        raise DistillError(f"{len(keep)} kept teacher blocks for a {s_pattern.num_layers}-block student")
    check_keep(teacher, keep)
    for i, k in enumerate(keep):
        if s_pattern.experts_at(i) != t_pattern.experts_at(k):
            raise DistillError(
                f"student block {i} has {s_pattern.experts_at(i)} experts but teacher block {k}, "
                f"which initialises it, has {t_pattern.experts_at(k)}"
            )


@torch.no_grad()
def init_student_(student: nn.Module, teacher: nn.Module, keep: list[int]) -> None:
    """Copy everything outside the layers, and the ``keep`` layers, of ``teacher`` into
    ``student`` (``blocks.N.`` names, as every family's ``CausalLM`` has).

    Both models must be built with the same ep_size: expert tensors are this rank's
    slice [E_local, ...] in both, so copying them locally is correct on every rank.
    """
    t_sd = teacher.state_dict()
    new = {}
    for name, s_t in student.state_dict().items():
        src = name
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            src = f"blocks.{keep[int(i)]}.{rest}"
        if src not in t_sd:
            raise DistillError(f"student parameter {name}: the teacher has no {src}")
        if t_sd[src].shape != s_t.shape:
            raise DistillError(
                f"student parameter {name} has shape {tuple(s_t.shape)} but the teacher's {src} "
                f"has {tuple(t_sd[src].shape)} (different widths or ep_size?)"
            )
        new[name] = t_sd[src]
    student.load_state_dict(new)


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float = 1.0) -> torch.Tensor:
    """T^2 * KL(softmax(teacher/T) || softmax(student/T)), summed over the vocabulary and
    averaged over tokens, in float32. T^2 keeps its gradient scale independent of T."""
    if student_logits.shape != teacher_logits.shape:
        raise DistillError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: vocabularies (last dim) and batches must match"
        )
    V = student_logits.shape[-1]
    log_s = F.log_softmax(student_logits.float().reshape(-1, V) / T, dim=-1)
    log_t = F.log_softmax(teacher_logits.float().reshape(-1, V) / T, dim=-1)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")
    return kl * (T * T)
