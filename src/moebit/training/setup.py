"""What the loop builds before its first step: the optimizer and its schedule, the
starting weights (a resumed checkpoint, or rank 0's broadcast), the metrics log, and the
counters of earlier attempts."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moebit.comm.collectives import DistInfo, broadcast_params_
from moebit.comm.outer_groups import OuterGroups, inner_param_groups, outer_groups
from moebit.models.hf import HFDecoderConfig, build_empty
from moebit.models.interface import CausalLM, is_expert_param
from moebit.models.registry import build_model
from moebit.moe import split_params_for_ep
from moebit.optim import OuterOptimizer, build_optimizer, build_outer_optimizer
from moebit.runs import dtype_probe
from moebit.runs.metrics import MetricsWriter
from moebit.training import state as ckpt_io
from moebit.training.config import TrainConfig
from moebit.training.data import TrainBatches
from moebit.training.hooks import is_nothing
from moebit.training.meter import RunTotals
from moebit.training.shard_loop import shard_state


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def param_groups(model: CausalLM, cfg: TrainConfig | None = None,
                 groups: OuterGroups | None = None) -> list[dict[str, Any]]:
    """One group for data-parallel parameters; with expert parallelism the experts get
    their own group, averaged over the expert-data-parallel group only. With an outer
    optimizer (``groups``) every average stays inside the worker: dense parameters over
    the inner group, experts over the inner group's ranks of their ep rank."""
    if groups is not None:
        trainable = [p for p in model.parameters() if p.requires_grad]  # type: ignore[attr-defined]
        return inner_param_groups(trainable, groups, is_expert_param)
    if model.ep_groups is not None and shard_state(model) is None:  # FSDP averages experts
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


def make_outer_groups(cfg: TrainConfig) -> OuterGroups | None:
    """The inner and outer groups of an outer optimizer (None without one); a collective:
    every rank calls it at the same point, after the model made its expert groups."""
    if cfg.outer == "none":
        return None
    return outer_groups(cfg.outer_group, ep_size=cfg.moe.ep_size if cfg.moe else 1)


def model_blocks(model: Any) -> list[list[torch.Tensor]]:
    """The model cut into the outer optimizer's blocks, in order: the parameters before the
    decoder blocks (embeddings), each decoder block, the parameters after (final norm,
    head). Works on any ``CausalLM`` (its ``blocks`` list); frozen parameters are left out,
    and a parameter tied to an earlier one appears once."""
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    before: list[torch.Tensor] = []
    after: list[torch.Tensor] = []
    seen_block = False
    for p in model.parameters():
        if id(p) in in_blocks:
            seen_block = True
        elif p.requires_grad:
            (after if seen_block else before).append(p)
    out = [before] + [[p for p in b.parameters() if p.requires_grad] for b in model.blocks]
    return [b for b in out + [after] if b]


def outer_fragments(cfg: TrainConfig, n_blocks: int) -> int:
    """F: ``outer_fragments``, or by default 1 for DiLoCo and, for Streaming DiLoCo, as many
    as the model's blocks, the interval (F <= H) and the overlap (D*F < H) allow."""
    if cfg.outer_fragments:
        return cfg.outer_fragments
    if cfg.outer != "streaming_diloco":
        return 1
    cap = (cfg.outer_every - 1) // cfg.outer_delay if cfg.outer_delay else cfg.outer_every
    return max(1, min(n_blocks, cfg.outer_every, cap))


def outer_keys(cfg: TrainConfig, n_blocks: int) -> dict[str, Any]:
    """The flat keys ``build_outer_optimizer`` takes, from the config."""
    return {"outer_every": cfg.outer_every, "outer_lr": cfg.outer_lr,
            "outer_momentum": cfg.outer_momentum, "outer_nesterov": cfg.outer_nesterov,
            "outer_compress": cfg.outer_compress,
            "outer_fragments": outer_fragments(cfg, n_blocks), "outer_delay": cfg.outer_delay,
            "outer_alpha": cfg.outer_alpha, "outer_int8_block": cfg.outer_int8_block,
            "outer_onebit_block": cfg.outer_onebit_block,
            "outer_fragment_cut": cfg.outer_fragment_cut}


def make_outer(cfg: TrainConfig, model: CausalLM, opt: torch.optim.Optimizer,
               groups: OuterGroups | None) -> OuterOptimizer | None:
    """DiLoCo / Streaming DiLoCo around ``opt``, built once every replica holds the same
    weights (after the broadcast or the restore): theta_sync starts from them."""
    if groups is None:
        return None
    blocks = model_blocks(model)
    # A node's ranks hold one dense replica unless it is sharded over them: they split the
    # exchange, so the slow link carries it once (OuterOptimizer's share group).
    share = groups.share if cfg.shard == "none" else None
    return build_outer_optimizer(opt, blocks, groups.outer, share,
                                 **outer_keys(cfg, len(blocks)))


def outer_start_fields(outer: OuterOptimizer | None, groups: OuterGroups | None
                       ) -> dict[str, Any]:
    """The outer optimizer's shape for the ``start`` record (nothing without one)."""
    if outer is None or groups is None:
        return {}
    return {"outer_workers": groups.workers, "outer_fragments": outer.fragments,
            "outer_state_bytes": outer.state_bytes()}


def outer_topology(groups: OuterGroups) -> dict[str, Any]:
    """What a checkpoint's outer state depends on besides the schedule: a resume must find
    the same workers (outer group) and node size, or theta_sync would belong to others."""
    return {"outer_group": groups.mode, "local_world_size": groups.local_world_size,
            "outer_ranks": list(groups.outer_ranks)}


def load_outer(outer: OuterOptimizer, groups: OuterGroups, resumed: ckpt_io.Resumed) -> None:
    """Restore this rank's outer state from the checkpoint, on the same topology."""
    saved = resumed.outer or {}
    now = outer_topology(groups)
    for key, value in now.items():
        if saved.get("topology", {}).get(key) != value:
            raise ckpt_io.CheckpointError(
                f"{resumed.path}: its outer state was saved with {key}="
                f"{saved.get('topology', {}).get(key)!r}, this run has {value!r} (LOCAL_WORLD_SIZE "
                "and outer_group must match: theta_sync belongs to its workers)")
    try:
        outer.load_state_dict(saved["state"])
    except (KeyError, ValueError) as e:
        raise ckpt_io.CheckpointError(f"{resumed.path}: {e}") from None


def outer_checkpoint(outer: OuterOptimizer | None, groups: OuterGroups | None
                     ) -> dict[str, Any] | None:
    """What a checkpoint keeps of the outer optimizer (``save(outer_state=...)``)."""
    if outer is None or groups is None:
        return None
    return {"state": outer.state_dict(), "topology": outer_topology(groups)}


def broadcast_model(model: CausalLM) -> None:
    """Rank 0's initial weights everywhere; each expert from its expert-data-parallel root."""
    ep = model.ep_groups
    if ep is None:
        broadcast_params_(model)  # type: ignore[arg-type]
    else:
        broadcast_params_(model, expert_dp_group=ep.expert_dp_group,  # type: ignore[arg-type]
                          expert_src=ep.expert_dp_ranks[0], is_expert=is_expert_param)


def build_run_model(cfg: TrainConfig, init_model: Callable[[Any], None],
                    device: torch.device | str) -> CausalLM:
    """This rank's model: built or loaded, the hooks' ``init_model``, then sharded under
    ``shard``. Sharded, no rank holds the whole model (``shard_build.build_sharded_run``:
    a fresh model is built on the meta device and each rank initialises only its shards;
    ``--init-from`` a Hugging Face folder reads each rank's own rows). A hook
    ``init_model`` needs the whole model: it is then built whole (a folder's model
    empty, read after sharding), and sharded after the hook."""
    if cfg.shard != "none" and is_nothing(init_model):
        from moebit.training.shard_build import build_sharded_run

        sharded = build_sharded_run(cfg, device)
        if sharded is not None:
            return sharded  # type: ignore[no-any-return]
    mcfg = cfg.model_config()
    if cfg.shard != "none" and cfg.init_from and isinstance(mcfg, HFDecoderConfig):
        from moebit.training.shard_build import shard
        from moebit.training.shard_init import load_hf_sharded

        model = build_empty(mcfg)
        init_model(model)
        shard(cfg, model)
        load_hf_sharded(model, str(cfg.init_from))
        return model  # type: ignore[return-value]
    model = build_model(cfg).to(device)  # type: ignore[attr-defined]
    init_model(model)
    shard_if_asked(cfg, model)
    return model


def shard_if_asked(cfg: TrainConfig, model: CausalLM) -> bool:
    """Under ``shard``: rank 0's initial weights everywhere, then FSDP2 over the ranks (in
    place), before the optimizer is built on the sharded parameters. Returns whether the
    model is now sharded."""
    if cfg.shard == "none":
        return False
    from moebit.training.shard_build import shard

    broadcast_model(model)  # the replicas agree before each rank keeps its shard
    shard(cfg, model)
    return True


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
    if resumed is None and shard_state(model) is None:  # a sharded model was broadcast before
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
            "optimizer": cfg.optimizer, "outer": cfg.outer, "unigram_entropy": corpus.unigram_entropy(),
            "corpus": corpus.source, "train_bytes": len(corpus.train),
            "val_bytes": len(corpus.val), "threads": torch.get_num_threads(),
            **dtype_probe.start_fields(cfg.dtype)}
