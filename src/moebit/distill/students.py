"""The student of Mixture-of-Students: which teacher blocks it keeps, its configuration,
its initialisation from the teacher, and the KD loss that matches it to the teacher.

Pure functions of configurations and models; the training stage that uses them is
``moebit.distill.run``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moebit.models.gpt import GPTConfig

SHAPE_KEYS = ("vocab_size", "d_model", "n_head", "d_ffn", "block_size")


class DistillError(ValueError):
    """Teacher and student do not fit together, or a distillation setting is invalid."""


def block_experts(cfg: GPTConfig) -> list[int]:
    """Experts per block (0: dense), the block 'kind' a kept layer must match."""
    return [cfg.experts_at(i) for i in range(cfg.n_layer)]


def _student_is_moe(teacher: GPTConfig, n_layer: int) -> list[bool]:
    """Which blocks of an ``n_layer`` student are MoE: the teacher's ``moe_every`` rule."""
    return [teacher.is_moe and (i + 1) % teacher.moe_every == 0 for i in range(n_layer)]


def choose_layers(teacher: GPTConfig, n_student: int) -> list[int]:
    """The teacher block that initialises each student block.

    Rule: keep the teacher's relative depth. Among all increasing choices whose kinds
    fit the student's pattern (an MoE slot takes an MoE block, a dense slot a dense one,
    so the dense/MoE alternation stays valid), take the one minimising
    sum_i |keep[i]/(T-1) - i/(L-1)|. Why: each kept block then reads a residual stream
    of about the depth it was trained on; the first block (which reads raw embeddings)
    and, whenever the pattern allows, the last block (which writes what ``ln_f`` and the
    head decode) are kept, and the blocks dropped come from the middle, the most
    redundant part of a deep LM (layer-pruning studies find middle blocks removable and
    the first and last ones essential). Dropping an (MoE, dense) pair from the middle also
    keeps the pyramid's largest, last MoE block. With ``moe_every`` 2, a student of odd
    depth must end on a dense block, so it keeps the teacher's first L blocks.
    """
    T, L = teacher.n_layer, n_student
    if not 1 <= L <= T:
        raise DistillError(f"--student-layers must be in [1, {T}] (the teacher has {T} blocks), got {L}")
    t_moe = [e > 0 for e in block_experts(teacher)]
    s_moe = _student_is_moe(teacher, L)
    return keep_by_depth(T, L, lambda i, j: t_moe[j] == s_moe[i])


def keep_by_depth(T: int, L: int, fits: Callable[[int, int], bool]) -> list[int]:
    """The increasing ``keep`` (student block i <- teacher block keep[i]) minimising
    sum_i |keep[i]/(T-1) - i/(L-1)| among those where ``fits(i, keep[i])`` holds for all i
    (a dynamic program over (student block, teacher block)); ties keep the earliest block.
    Shared by moebit's GPT and the Hugging Face families, which differ only in ``fits``."""
    def cost(i: int, j: int) -> float:
        return abs((j / (T - 1) if T > 1 else 0.0) - (i / (L - 1) if L > 1 else 0.0))

    inf = math.inf
    best = [[inf] * T for _ in range(L)]  # best[i][j]: student blocks 0..i placed, i on j
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
        raise DistillError(f"no {L}-block student fits the teacher's dense/MoE pattern")
    keep = [end]
    for i in range(L - 1, 0, -1):
        keep.append(back[i][keep[-1]])
    return keep[::-1]


def student_config(teacher: GPTConfig, keep: list[int]) -> GPTConfig:
    """The teacher's configuration with only the ``keep`` blocks (their expert counts)."""
    check_keep(teacher, keep)
    counts = [teacher.experts_at(k) for k in keep if teacher.experts_at(k) > 0]
    d = teacher.to_dict()
    d["n_layer"] = len(keep)
    if not counts:
        d["num_experts"], d["moe"] = 0, None
    elif isinstance(teacher.num_experts, int):
        d["num_experts"] = teacher.num_experts
    else:
        d["num_experts"] = counts
    return GPTConfig(**d)


def check_keep(teacher: GPTConfig, keep: list[int]) -> None:
    """``keep`` is increasing, in range, and fits the student's dense/MoE pattern."""
    T = teacher.n_layer
    if not keep:
        raise DistillError("the student needs at least one block (--keep-layers is empty)")
    bad = [k for k in keep if not 0 <= k < T]
    if bad:
        raise DistillError(f"--keep-layers {keep}: blocks {bad} do not exist (the teacher has {T})")
    if any(b <= a for a, b in zip(keep, keep[1:], strict=False)):
        raise DistillError(f"--keep-layers {keep}: must be strictly increasing (blocks keep their order)")
    s_moe = _student_is_moe(teacher, len(keep))
    for i, k in enumerate(keep):
        if (teacher.experts_at(k) > 0) != s_moe[i]:
            want = "an MoE" if s_moe[i] else "a dense"
            raise DistillError(
                f"--keep-layers {keep}: student block {i} is {want} block (moe_every="
                f"{teacher.moe_every}) but teacher block {k} is not; the dense/MoE kinds must match"
            )


def check_compatible(teacher: GPTConfig, student: GPTConfig, keep: list[int]) -> None:
    """Raise DistillError naming the first way ``student`` cannot be made from ``teacher``."""
    for key in SHAPE_KEYS:
        t, s = getattr(teacher, key), getattr(student, key)
        if t != s:
            raise DistillError(
                f"teacher and student differ in {key} (teacher {t}, student {s}): the student "
                f"is initialised from the teacher's weights and matches its logits, so {key} must match"
            )
    if len(keep) != student.n_layer:
        raise DistillError(f"{len(keep)} kept teacher blocks for a {student.n_layer}-block student")
    check_keep(teacher, keep)
    for i, k in enumerate(keep):
        if student.experts_at(i) != teacher.experts_at(k):
            raise DistillError(
                f"student block {i} has {student.experts_at(i)} experts but teacher block {k}, "
                f"which initialises it, has {teacher.experts_at(k)}"
            )
    t_res = bool(teacher.moe and teacher.moe.residual)
    s_res = bool(student.moe and student.moe.residual)
    if student.is_moe and t_res != s_res:
        raise DistillError(f"teacher residual MoE = {t_res} but student = {s_res}: the blocks differ")


@torch.no_grad()
def init_student_(student: nn.Module, teacher: nn.Module, keep: list[int]) -> None:
    """Copy embeddings, final norm and the ``keep`` blocks of ``teacher`` into ``student``.

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
