"""What the loop builds before its first step: the optimizer and its schedule, the
starting weights (a resumed checkpoint, or rank 0's broadcast), the metrics log, and the
counters of earlier attempts."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from moebit.comm.collectives import DistInfo, broadcast_params_
from moebit.models.interface import CausalLM, is_expert_param
from moebit.moe import split_params_for_ep
from moebit.optim import build_optimizer
from moebit.runs import dtype_probe
from moebit.runs.metrics import MetricsWriter
from moebit.training import state as ckpt_io
from moebit.training.config import TrainConfig
from moebit.training.data import TrainBatches
from moebit.training.meter import RunTotals


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def param_groups(model: CausalLM, cfg: TrainConfig | None = None) -> list[dict[str, Any]]:
    """One group for data-parallel parameters; with expert parallelism the experts get
    their own group, averaged over the expert-data-parallel group only."""
    if model.ep_groups is not None:
        return split_params_for_ep(model)  # type: ignore[arg-type]
    return [{"params": [p for p in model.parameters() if p.requires_grad]}]  # type: ignore[attr-defined]


def make_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return build_optimizer(
        cfg.optimizer,
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        freeze_step=cfg.resolved_freeze_step(),
        **cfg.extra,
    )


def broadcast_model(model: CausalLM) -> None:
    """Rank 0's initial weights everywhere; each expert from its expert-data-parallel root."""
    ep = model.ep_groups
    if ep is None:
        broadcast_params_(model)  # type: ignore[arg-type]
    else:
        broadcast_params_(model, expert_dp_group=ep.expert_dp_group,  # type: ignore[arg-type]
                          expert_src=ep.expert_dp_ranks[0], is_expert=is_expert_param)


def open_metrics(run_dir: Path, info: DistInfo, resumed_at: int | None) -> MetricsWriter | None:
    """Rank 0's metrics log, with the records after a resumed checkpoint dropped."""
    if not info.is_main:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    if resumed_at is not None:
        ckpt_io.trim_metrics(run_dir / "metrics.jsonl", resumed_at)
    return MetricsWriter(run_dir / "metrics.jsonl")


def resume_or_broadcast(run_dir: Path, model: CausalLM, opt: torch.optim.Optimizer,
                        batches: TrainBatches, info: DistInfo, cfg: TrainConfig
                        ) -> ckpt_io.Resumed | None:
    """Continue from the newest checkpoint (``--resume``, or torchrun restarted the ranks),
    else start every rank from rank 0's weights. A restart before the first checkpoint
    starts over."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resumed = None
    if cfg.resume or restarted:
        resumed = ckpt_io.restore(run_dir, model, opt, batches, info, cfg)  # type: ignore[arg-type]
    if resumed is None:
        broadcast_model(model)
    return resumed


def saved_totals(resumed: ckpt_io.Resumed | None, tokens_per_step: int) -> RunTotals:
    """The counters of the attempts before this one (none for a fresh run)."""
    if resumed is None:
        return RunTotals()
    if "totals" in resumed.run_state:
        return RunTotals.from_dict(resumed.run_state["totals"])
    # A checkpoint older than the counters: its time and steps are known, its bytes not.
    return RunTotals(train_time=resumed.train_time, steps_trained=resumed.step,
                     tokens=resumed.step * tokens_per_step)


def start_record(cfg: TrainConfig, info: DistInfo, model: CausalLM, corpus: Any) -> dict[str, Any]:
    return {"kind": "start", "n_params": model.num_params(), "world_size": info.world_size,
            "n_expert_params": model.num_expert_params(),
            "optimizer": cfg.optimizer, "unigram_entropy": corpus.unigram_entropy(),
            "corpus": corpus.source, "train_bytes": len(corpus.train),
            "val_bytes": len(corpus.val), "threads": torch.get_num_threads(),
            **dtype_probe.start_fields(cfg.dtype)}
