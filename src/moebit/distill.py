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

Each rank runs ``python -m moebit.distill --resolved-config RUN/config.json``, launched
by ``moebit distill`` (``moebit.cli.distill``); ``RUN/distill.json`` holds the settings
below. The run folder is an ordinary moebit run (same metrics records as ``moebit train``,
plus ``kd_loss`` on train records and a ``kd_stop`` record), so ``moebit report`` and
``moebit generate`` work on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moebit.config import TrainConfig, build
from moebit.metrics import MetricsWriter
from moebit.models.gpt import GPT, GPTConfig

DISTILL_FILE = "distill.json"
SHAPE_KEYS = ("vocab_size", "d_model", "n_head", "d_ffn", "block_size")


class DistillError(ValueError):
    """Teacher and student do not fit together, or a distillation setting is invalid."""


@dataclass
class DistillConfig:
    teacher: str  # the teacher's run folder (its newest complete checkpoint is used)
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


# --------------------------------------------------------------------------- the student


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

    def cost(i: int, j: int) -> float:
        return abs((j / (T - 1) if T > 1 else 0.0) - (i / (L - 1) if L > 1 else 0.0))

    inf = math.inf
    best = [[inf] * T for _ in range(L)]  # best[i][j]: student blocks 0..i placed, i on j
    back = [[-1] * T for _ in range(L)]
    for j in range(T):
        if t_moe[j] == s_moe[0]:
            best[0][j] = cost(0, j)
    for i in range(1, L):
        run_min, run_arg = inf, -1
        for j in range(T):
            if j > 0 and best[i - 1][j - 1] < run_min:  # strict '<': ties keep the earliest
                run_min, run_arg = best[i - 1][j - 1], j - 1
            if t_moe[j] == s_moe[i] and run_min < inf:
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
        d["num_experts"], d["moe"] = 0, {}
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
    t_res, s_res = bool(teacher.moe.get("residual")), bool(student.moe.get("residual"))
    if student.is_moe and t_res != s_res:
        raise DistillError(f"teacher residual MoE = {t_res} but student = {s_res}: the blocks differ")


@torch.no_grad()
def init_student_(student: GPT, teacher: GPT, keep: list[int]) -> None:
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


# --------------------------------------------------------------------------- configuration


def load_teacher_config(teacher_run: str | Path) -> tuple[TrainConfig, Path]:
    """The teacher's TrainConfig and its newest complete checkpoint folder."""
    from moebit.checkpoint import latest

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


# --------------------------------------------------------------------------- one rank


def run(cfg: TrainConfig, dcfg: DistillConfig, run_dir: Path) -> dict[str, Any]:
    from moebit.comm.collectives import init_from_env

    info = init_from_env(cfg.device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    try:
        return distill(cfg, dcfg, run_dir, info)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_teacher(dcfg: DistillConfig, ep_size: int, rank: int) -> tuple[GPT, TrainConfig, int]:
    """The teacher, sharded for ``ep_size`` (its checkpoint may have another), frozen; with
    its config and the step of the checkpoint loaded."""
    from moebit.checkpoint import read_manifest
    from moebit.checkpoint.train_state import load_model_weights

    t_cfg, ckpt = load_teacher_config(dcfg.teacher)
    if t_cfg.num_experts:
        t_cfg.ep_size = ep_size
    teacher = GPT(t_cfg.model_config())
    manifest = read_manifest(ckpt)
    load_model_weights(ckpt, manifest, teacher, rank, ep_size if t_cfg.num_experts else 1)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher, t_cfg, int(manifest["step"])


def distill(cfg: TrainConfig, dcfg: DistillConfig, run_dir: Path, info: Any) -> dict[str, Any]:
    """Train the student on this rank (data parallel + expert parallel, as ``moebit.train``)."""
    from moebit import train as tr
    from moebit.checkpoint import train_state as ckpt_io
    from moebit.comm import stats
    from moebit.data import TrainBatches, check_block_size, load_corpus, val_batches

    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data, cfg.encoding, cfg.encoding_errors)
    check_block_size(corpus, cfg.block_size)
    teacher, t_cfg, teacher_step = build_teacher(dcfg, cfg.ep_size, info.rank)
    teacher.to(info.device)
    keep = dcfg.keep_layers or choose_layers(t_cfg.model_config(), dcfg.student_layers)
    check_compatible(teacher.config, cfg.model_config(), keep)
    model = GPT(cfg.model_config()).to(info.device)
    init_student_(model, teacher, keep)
    opt = tr.make_optimizer(cfg, tr.param_groups(model, cfg))
    batches = TrainBatches(corpus.train, cfg.block_size, cfg.batch_size, cfg.seed, info.rank)
    vbatches = val_batches(corpus.val, cfg.block_size, cfg.batch_size, cfg.eval_batches, cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.block_size * info.world_size
    kd_steps = dcfg.kd_steps(cfg.steps)
    kd_on, kd_used = kd_steps > 0, 0
    t_dtype = "bf16" if dcfg.teacher_dtype == "bf16" else "fp32"

    log = MetricsWriter(run_dir / "metrics.jsonl") if info.is_main else None

    def emit(rec: dict[str, Any]) -> None:
        if log is not None:
            log.emit(rec)

    teacher_val = tr.evaluate(teacher, vbatches, t_dtype, info.device)
    teacher.eval()  # evaluate() leaves models in train mode
    init_val = tr.evaluate(model, vbatches, cfg.dtype, info.device)
    n_params = model.num_params()
    emit({"kind": "start", "n_params": n_params, "n_expert_params": model.num_expert_params(),
          "world_size": info.world_size,
          "optimizer": cfg.optimizer, "unigram_entropy": corpus.unigram_entropy(),
          "corpus": corpus.source, "train_bytes": len(corpus.train), "val_bytes": len(corpus.val),
          "threads": torch.get_num_threads(), "teacher": str(dcfg.teacher),
          "teacher_step": teacher_step, "teacher_params": teacher.num_params(),
          "teacher_layers": teacher.config.n_layer, "keep_layers": keep,
          "teacher_val_loss": teacher_val, "init_val_loss": init_val, "kd_steps": kd_steps,
          "kd_stop_rule": dcfg.kd_stop_rule, "kd_weight": 0.0 if dcfg.no_kd else dcfg.kd_weight,
          "temperature": dcfg.temperature})
    if not kd_on:
        why = "--no-kd" if dcfg.no_kd else f"--kd-stop-fraction {dcfg.kd_stop_fraction}"
        emit({"kind": "kd_stop", "step": 0, "reason": f"{why}: LM + aux loss from the start"})
    bar = None
    if info.is_main:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc="distill", unit="step", mininterval=1.0,
                   file=sys.stderr, dynamic_ncols=True)
    t_start = time.perf_counter()
    train_time = 0.0
    win = {"loss": 0.0, "aux": 0.0, "kd": 0.0, "n": 0, "n_kd": 0, "time": 0.0}
    win_stats = stats.snapshot()
    val_loss, last_moe = float("nan"), {}
    model.train()
    for step in range(cfg.steps):
        if kd_on and step == kd_steps:
            kd_on = False
            emit({"kind": "kd_stop", "step": step, "rule": "fraction",
                  "fraction": dcfg.kd_stop_fraction,
                  "reason": f"KD ran for round({dcfg.kd_stop_fraction} * {cfg.steps}) steps; "
                            "LM + aux loss only from here"})
        elif kd_on and dcfg.kd_stop_rule == "catch-up" and step and step % dcfg.kd_check_every == 0:
            v = _caught_up(model, vbatches, cfg.dtype, info.device, teacher_val)
            if v is not None:
                kd_on = False
                emit({"kind": "kd_stop", "step": step, "rule": "catch-up", "val_loss": v,
                      "teacher_val_loss": teacher_val,
                      "reason": "the student's validation loss reached the teacher's: KD can "
                                "only pull it back; LM + aux loss only from here"})
        use_kd = kd_on
        kd_used += int(use_kd)
        t0 = time.perf_counter()
        lr = tr.lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batches.next()
        x, y = x.to(info.device), y.to(info.device)
        with tr.autocast(cfg.dtype, info.device):
            out = model(x, y)
        loss = out.loss + out.aux_loss
        kd_value = 0.0
        if use_kd:
            with torch.no_grad(), tr.autocast(t_dtype, info.device):
                t_logits = teacher(x).logits
            kd = kd_loss(out.logits, t_logits, dcfg.temperature)
            loss = loss + dcfg.kd_weight * kd
            kd_value = float(kd.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        averaged = tr.average_for_step(opt)
        norm = tr.clip_gradients(model, cfg.grad_clip)
        loss_value = float(out.loss.detach())
        # Every rank must agree before raising: a lone rank that stops leaves the others
        # blocked in the optimizer's collective until the process-group timeout.
        if tr.any_rank(not (math.isfinite(loss_value) and math.isfinite(norm)), not averaged):
            raise tr.NonFiniteLoss(f"non-finite loss or gradient at step {step + 1} on some "
                                   f"rank (this rank: loss={loss_value}, grad norm={norm})")
        opt.step()
        dt = time.perf_counter() - t0
        train_time += dt
        win["time"] += dt
        win["loss"] += loss_value
        win["aux"] += float(out.aux_loss.detach())
        win["n"] += 1
        if use_kd:
            win["kd"] += kd_value
            win["n_kd"] += 1
        if cfg.num_experts:
            last_moe = tr.moe_metrics(out.ffn_outputs)
        last = step == cfg.steps - 1
        if (step + 1) % cfg.log_every == 0 or last:
            now = stats.snapshot()
            d = now.minus(win_stats)
            n = win["n"]
            rec = {"kind": "train", "step": step + 1, "loss": win["loss"] / n, "lr": lr,
                   "tokens_per_s": tokens_per_step * n / win["time"],
                   "bytes_sent": now.bytes_sent, "bytes_recv": now.bytes_recv,
                   "step_bytes_sent": d.bytes_sent / n, "step_bytes_recv": d.bytes_recv / n,
                   "comm_seconds_per_step": sum(o.seconds for o in d.ops.values()) / n,
                   "wall": time.perf_counter() - t_start, "train_time": train_time,
                   "comm_stage": getattr(opt, "comm_stage", "exact")}
            if win["n_kd"]:
                rec["kd_loss"] = win["kd"] / win["n_kd"]
            if cfg.num_experts:
                rec["aux_loss"] = win["aux"] / n
                rec.update(last_moe)
            emit(rec)
            if bar is not None:
                post = {"loss": f"{rec['loss']:.3f}", "tok_s": f"{rec['tokens_per_s']:.0f}"}
                if "kd_loss" in rec:
                    post["kd"] = f"{rec['kd_loss']:.3f}"
                bar.set_postfix(post, refresh=False)
            win = {"loss": 0.0, "aux": 0.0, "kd": 0.0, "n": 0, "n_kd": 0, "time": 0.0}
            win_stats = now
        if (step + 1) % cfg.eval_every == 0 or last:
            val_loss = tr.evaluate(model, vbatches, cfg.dtype, info.device)
            emit({"kind": "eval", "step": step + 1, "val_loss": val_loss,
                  "wall": time.perf_counter() - t_start, "train_time": train_time,
                  "bytes_sent": stats.snapshot().bytes_sent})
        if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            ckpt_io.save(run_dir, step + 1, model, opt, batches, info, cfg,
                         wall=time.perf_counter() - t_start, train_time=train_time)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    total = stats.snapshot()
    summary = {
        "kind": "end", "steps": cfg.steps, "val_loss": val_loss, "n_params": n_params,
        "unigram_entropy": corpus.unigram_entropy(), "wall": time.perf_counter() - t_start,
        "train_time": train_time, "bytes_sent": total.bytes_sent, "bytes_recv": total.bytes_recv,
        "tokens_per_s": tokens_per_step * cfg.steps / max(train_time, 1e-9),
        "frozen_at": getattr(opt, "frozen_at", None), "nan_skipped": 0,
        "kd_steps": kd_used, "teacher_val_loss": teacher_val, "teacher_params": teacher.num_params(),
        "val_vs_teacher": val_loss / teacher_val,
    }
    emit(summary)
    if log is not None:
        log.close()
        from moebit.report import plot_runs

        plot_runs([run_dir], run_dir)
    return summary


def _caught_up(model: GPT, vbatches: list[Any], dtype: str, device: torch.device,
               teacher_val: float) -> float | None:
    """The student's validation loss if it is <= the teacher's, else None.

    Rank 0 decides and broadcasts: the ranks' losses agree only to rounding, and a rank
    that stopped running the teacher while another still ran it would hang the teacher's
    all-to-all.
    """
    from moebit.train import evaluate

    v = evaluate(model, vbatches, dtype, device)
    flag = torch.tensor([1.0 if v <= teacher_val else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(flag, src=0)
    return v if flag.item() > 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moebit.distill", description=__doc__)
    ap.add_argument("--resolved-config", required=True,
                    help=f"config.json written by `moebit distill` (with {DISTILL_FILE} beside it)")
    args = ap.parse_args(argv)
    path = Path(args.resolved_config)
    cfg = build(json.loads(path.read_text()), source=str(path))
    dcfg = DistillConfig.from_dict(json.loads((path.parent / DISTILL_FILE).read_text()))
    summary = run(cfg, dcfg, path.parent)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
