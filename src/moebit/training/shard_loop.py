"""The loop's side of sharded training: the ``ShardConfig`` of a ``TrainConfig``, the
clipping norm of sharded gradients, the memory fields of every end record, and the DCP
checkpoints the loop writes and resumes from under ``shard``.

``moebit.training.sharding`` shards a model; this module is what the loop (and
``moebit.training.state``) call so that resume, ``--save-every``, ``--max-restarts``
and the end record work the same sharded or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moebit.checkpoint.files import CheckpointError, prune
from moebit.comm.collectives import DistInfo
from moebit.training.config import TrainConfig
from moebit.training.data import TrainBatches
from moebit.training.shard_config import ShardConfig
from moebit.training.shard_memory import peak_rss_mb, state_bytes_per_rank

if TYPE_CHECKING:  # FSDP2, DTensor and DCP are imported by sharded runs only
    from moebit.training.sharding import ShardState


def shard_config(cfg: TrainConfig) -> ShardConfig:
    """The sharding settings of a run (hsdp's node size comes from torchrun). Under an
    outer optimizer fsdp shards inside each node only (``node_local``): the nodes are the
    DiLoCo workers, which share nothing between syncs."""
    return ShardConfig(shard=cfg.shard, reshard_after_forward=cfg.reshard_after_forward,
                       unit=cfg.shard_unit, transport=cfg.shard_transport,
                       param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype,
                       rs_compress=cfg.rs_compress, ag_compress=cfg.ag_compress,
                       node_local=cfg.shard == "fsdp" and cfg.outer != "none")


def shard_state(model: nn.Module) -> ShardState | None:
    """What ``shard_model`` left on the model, or None for a replicated model."""
    return getattr(model, "moebit_shard", None)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def clip_sharded(model: nn.Module, max_norm: float) -> float:
    """Clip sharded gradients by their global norm, the same on every rank.

    Each rank squares its local shards; dense sums go over the dense mesh's shard
    dimension (hsdp's replicas hold the same shards: not summed again), expert sums
    over efsdp and then over the expert-parallel group (different experts), so every
    rank gets the norm the replicated run computes.
    """
    st = shard_state(model)
    assert st is not None, "clip_sharded: the model is not sharded"
    experts = set(st.expert_names) if st.meshes.experts is not None else set()
    dense_sq = torch.zeros((), dtype=torch.float32)
    expert_sq = torch.zeros((), dtype=torch.float32)
    grads: list[torch.Tensor] = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = _local(p.grad)
        grads.append(g)
        if name in experts:
            expert_sq += g.float().pow(2).sum()
        else:
            dense_sq += g.float().pow(2).sum()
    dist.all_reduce(dense_sq, group=st.meshes.dense.get_group("dp_shard"))
    if st.meshes.experts is not None:
        dist.all_reduce(expert_sq, group=st.meshes.experts.get_group("efsdp"))
        dist.all_reduce(expert_sq, group=model.ep_groups.ep_group)  # type: ignore[union-attr]
    norm = float((dense_sq + expert_sq).sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm


def memory_fields(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's model-state bytes at rest (sharded units resharded first: without
    ``reshard_after_forward`` the last evaluation leaves them gathered) and peak RSS, for
    the end record (every run); sharded runs add the transports their collectives chose."""
    st = shard_state(model)
    if st is not None:
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
    b = state_bytes_per_rank(model, opt)
    out: dict[str, Any] = {"state_bytes_per_rank": b.total, "param_bytes_per_rank": b.params,
                           "grad_bytes_per_rank": b.grads, "optimizer_bytes_per_rank": b.optimizer,
                           "peak_rss_mb": round(peak_rss_mb(), 1)}
    if st is not None:
        out["shard_transports"] = st.transports()
    return out


def save_dcp(d: Path, run_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer,
             batches: TrainBatches, info: DistInfo, cfg: TrainConfig, *, wall: float,
             train_time: float, run_state: dict[str, Any] | None,
             outer_state: dict[str, Any] | None = None) -> Path:
    """The loop's checkpoint of a sharded run: DCP shards from every rank (nothing
    gathered), the manifest fields of a replicated checkpoint (step, model config,
    config), and each rank's RNG, data position and outer optimizer state (its shards of
    theta_sync, momentum and error buffers: a per-rank file of the checkpoint, valid on the
    same topology); older checkpoints are pruned."""
    from moebit.training.dcp import save_sharded

    rank_state = {"rng": torch.get_rng_state(), "batches": batches.state_dict(),
                  "run_state": run_state or {}}
    if outer_state is not None:
        rank_state["outer"] = outer_state
    fields = {"step": step, "optimizer_name": cfg.optimizer, "wall": wall,
              "train_time": train_time, "model_config": cfg.model_config().to_dict(),
              "config": cfg.to_dict()}
    save_sharded(d, model, opt, extra={"step": step}, rank_state=rank_state, fields=fields)
    if info.is_main:
        prune(run_dir, cfg.keep_checkpoints)
    dist.barrier()  # nobody runs ahead of the pruning
    return d


def check_kind(d: Path, manifest: dict[str, Any], cfg: TrainConfig) -> None:
    """A sharded run resumes from a DCP checkpoint and a replicated one from its own
    kind; one line naming the folder otherwise."""
    saved = "dcp" if manifest.get("kind") == "dcp" else "replicated"
    if saved == "dcp" and cfg.shard == "none":
        raise CheckpointError(f"{d} is a sharded (DCP) checkpoint (shard={manifest.get('shard')}); "
                              f"this run has shard=none: resume with --shard fsdp or hsdp, or "
                              f"export it (moebit export) and train --init-from the folder")
    if saved == "replicated" and cfg.shard != "none":
        raise CheckpointError(f"{d} is a replicated checkpoint; this run has shard={cfg.shard}: "
                              f"resume it with --shard none")


def restore_dcp(d: Path, manifest: dict[str, Any], model: nn.Module,
                opt: torch.optim.Optimizer, batches: TrainBatches, info: DistInfo,
                cfg: TrainConfig
                ) -> tuple[int, float, float, bool, dict[str, Any], dict[str, Any] | None]:
    """Load a DCP checkpoint into the sharded model and optimizer; returns (step, wall,
    train_time, resharded, run_state, outer state or None). Same topology: RNG and data position come back,
    so the run continues bit for bit; another one reseeds as a replicated resume does."""
    from moebit.training.dcp import load_rank_state, load_sharded

    check_kind(d, manifest, cfg)
    load_sharded(d, model, opt)
    st = shard_state(model)
    assert st is not None
    same = (manifest["world_size"], manifest["shard"], manifest["ep_size"]) == (
        info.world_size, st.config.shard, st.meshes.ep_size)
    mine = load_rank_state(d, info.rank)
    if mine is not None:
        batches.load_state_dict(mine["batches"])
    if same and mine is not None:
        torch.set_rng_state(mine["rng"])
    else:
        torch.manual_seed(int(manifest["config"]["seed"]) + int(manifest["step"]) + info.rank)
    return (int(manifest["step"]), float(manifest["wall"]), float(manifest["train_time"]),
            not same, (mine or {}).get("run_state", {}), (mine or {}).get("outer"))
