"""Saving and restoring a training run: sharded, atomic, verified, reshardable.

Each rank writes its own shard (its parameters, experts included, its optimizer state with
the 1-bit error buffers, its RNG and data-stream state); rank 0 then writes the manifest
(world size, ep size, step, config, SHA-256 and size of every shard), which commits the
checkpoint. A checkpoint without a manifest is ignored; a shard that fails its checksum is
an error naming the file.

Same world size and ep size: every rank loads its own shard, and the run continues bit for
bit. Otherwise the experts are redistributed: expert parameters (marked ``moebit_expert``,
stacked on dim 0 as [E_local, ...]) are concatenated over the old expert-parallel group
and each new rank takes its slice; the 1-bit error buffers are reset with a warning.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moebit.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    latest,
    load_file,
    prune,
    read_manifest,
    save_atomic,
    sha256_of,
    shard_name,
    step_dir,
    verify,
    write_manifest,
    write_text_atomic,
)
from moebit.checkpoint.weights import expert_names, load_model_weights, regatherer
from moebit.comm.collectives import DistInfo
from moebit.models.registry import family_of_dict
from moebit.runs import metrics
from moebit.training.config import TrainConfig
from moebit.training.data import TrainBatches
from moebit.training.shard_loop import restore_dcp, save_dcp


@dataclass
class Resumed:
    step: int
    wall: float
    train_time: float
    path: Path
    resharded: bool
    # What the loop saved beside the model: its whole-run counters and its hooks' state
    # (empty for a checkpoint written before they were saved).
    run_state: dict[str, Any] = field(default_factory=dict)
    # This rank's outer optimizer state and topology (``save(outer_state=...)``), or None.
    outer: dict[str, Any] | None = None


def _group_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of[id(p)] for p in g["params"]] for g in opt.param_groups]


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict without the (unpicklable, run-bound) process groups."""
    sd = opt.state_dict()
    sd["param_groups"] = [
        {k: v for k, v in g.items() if k != "process_group"} for g in sd["param_groups"]
    ]
    return sd


def load_optimizer_state(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    pgs = [g.get("process_group") for g in opt.param_groups]
    opt.load_state_dict(sd)
    for g, pg in zip(opt.param_groups, pgs, strict=True):
        if pg is not None:
            g["process_group"] = pg


def save(run_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
         batches: TrainBatches, info: DistInfo, cfg: TrainConfig, *, wall: float,
         train_time: float, run_state: dict[str, Any] | None = None,
         outer_state: dict[str, Any] | None = None) -> Path:
    """Write this rank's shard of step ``step``; rank 0 commits it with the manifest.

    ``run_state`` (plain values and tensors) comes back as ``Resumed.run_state``, and
    ``outer_state`` (this rank's DiLoCo state: every rank of a worker saves its own
    theta_sync and error buffers) as ``Resumed.outer``. A failed
    write (ENOSPC, EROFS, ...) removes the partial step folder and is one CheckpointError
    naming the folder, the cause and the previous checkpoint, which the failure never
    touches (pruning runs only after a commit).
    """
    d = step_dir(run_dir, step)
    previous = latest(run_dir)
    try:
        if getattr(model, "moebit_shard", None) is not None:  # sharded: DCP, nothing gathered
            return save_dcp(d, run_dir, step, model, opt, batches, info, cfg, wall=wall,
                            train_time=train_time, run_state=run_state, outer_state=outer_state)
        return _save(d, run_dir, step, model, opt, batches, info, cfg, wall, train_time, run_state,
                     outer_state)
    except OSError as e:
        if not (d / MANIFEST).is_file():
            shutil.rmtree(d, ignore_errors=True)
        why = os.strerror(e.errno) if e.errno else str(e)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint"
        raise CheckpointError(f"saving checkpoint {d} failed on rank {info.rank}: {why} "
                              f"({e.filename or d}); removed the partial folder; {kept}") from None


def _save(d: Path, run_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
          batches: TrainBatches, info: DistInfo, cfg: TrainConfig, wall: float,
          train_time: float, run_state: dict[str, Any] | None,
          outer_state: dict[str, Any] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    shard = {
        "step": step,
        "rank": info.rank,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer_state(opt),
        "optimizer_param_names": _group_names(model, opt),
        "rng": torch.get_rng_state(),
        "batches": batches.state_dict(),
        "wall": wall,
        "train_time": train_time,
        "run_state": run_state or {},
    }
    if outer_state is not None:
        shard["outer"] = outer_state
    path = d / shard_name(info.rank)
    save_atomic(shard, path)
    meta = {"rank": info.rank, "bytes": path.stat().st_size, "sha256": sha256_of(path)}
    metas = [meta]
    if info.world_size > 1:
        metas = [None] * info.world_size  # type: ignore[list-item]
        dist.all_gather_object(metas, meta)
    if info.is_main:
        write_manifest(d, {
            "step": step,
            "world_size": info.world_size,
            "ep_size": cfg.moe.ep_size if cfg.moe else 1,
            "optimizer": cfg.optimizer,
            "model_config": cfg.model_config().to_dict(),
            "config": cfg.to_dict(),
            "files": {shard_name(m["rank"]): {"bytes": m["bytes"], "sha256": m["sha256"]}
                      for m in metas},
        })
        prune(run_dir, cfg.keep_checkpoints)
    if info.world_size > 1:
        dist.barrier()  # nobody runs ahead of a checkpoint that is not committed yet
    return d


def check_model_config(manifest: dict[str, Any], now: dict[str, Any], where: Path) -> None:
    """Everything but the expert-parallel degree must match; that one may change (resharding).

    Both sides are read by their family first, so a manifest written before a setting
    existed (it then holds its default) still matches.
    """
    try:
        fam = family_of_dict(now)
        saved_fam = family_of_dict(manifest["model_config"], str(where))
        if saved_fam.name != fam.name:
            raise ValueError(f"a {saved_fam.name} model, this run trains a {fam.name} model")
        saved = fam.with_ep_size(fam.config_from_dict(manifest["model_config"]), 1).to_dict()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} holds another model type: {e}") from None
    now = fam.with_ep_size(fam.config_from_dict(now), 1).to_dict()
    diff = [k for k in now if saved.get(k) != now[k]]
    if diff:
        parts = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {now[k]!r}" for k in diff)
        raise CheckpointError(f"{where} holds another model ({parts})")


def restore(run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
            batches: TrainBatches, info: DistInfo, cfg: TrainConfig) -> Resumed | None:
    """Load the newest complete checkpoint of ``run_dir`` into this rank's objects."""
    d = latest(run_dir)
    if d is None:
        if cfg.resume:
            raise CheckpointError(f"--resume {run_dir}: the run has no complete checkpoint")
        return None  # restarted before the first checkpoint: start over
    manifest = read_manifest(d)
    check_model_config(manifest, cfg.model_config().to_dict(), d)
    if manifest.get("kind") == "dcp" or cfg.shard != "none":
        step, wall, train_time, resharded, run_state, outer = restore_dcp(
            d, manifest, model, opt, batches, info, cfg)
        check_outer_shard(d, cfg, outer)
        return Resumed(step, wall, train_time, d, resharded, run_state, outer)
    new_ep = cfg.moe.ep_size if cfg.moe else 1
    if manifest["world_size"] == info.world_size and manifest["ep_size"] == new_ep:
        verify(d, {"files": {shard_name(info.rank): manifest["files"][shard_name(info.rank)]}})
        shard = load_file(d / shard_name(info.rank))
        model.load_state_dict(shard["model"])
        load_optimizer_state(opt, shard["optimizer"])
        torch.set_rng_state(shard["rng"])
        batches.load_state_dict(shard["batches"])
        check_outer_shard(d, cfg, shard.get("outer"))
        return Resumed(shard["step"], shard["wall"], shard["train_time"], d, False,
                       shard.get("run_state", {}), shard.get("outer"))
    saved_outer = manifest["config"].get("outer", "none")
    if cfg.outer != "none" or saved_outer != "none":
        raise CheckpointError(
            f"{d}: an outer-optimizer run (outer={saved_outer} saved, {cfg.outer} now) resumes "
            f"only on the same world size and ep_size (saved {manifest['world_size']} / "
            f"{manifest['ep_size']}, now {info.world_size} / {new_ep}): every rank's "
            "theta_sync and error buffers are its own")
    shards = load_model_weights(d, manifest, model, info.rank, new_ep)
    _reshard_optimizer(d, shards, model, opt, regatherer(model, d, info.rank, new_ep))
    own = d / shard_name(info.rank)
    mine = shards[0]
    if info.rank < manifest["world_size"] and own.is_file():
        mine = load_file(own)
        batches.load_state_dict(mine["batches"])
    torch.manual_seed(int(manifest["config"]["seed"]) + int(manifest["step"]) + info.rank)
    if info.is_main:
        warnings.warn(
            f"resuming {d} on world size {info.world_size} / ep size {new_ep} (saved with "
            f"{manifest['world_size']} / {manifest['ep_size']}): experts redistributed; "
            "1-bit error buffers reset", stacklevel=2)
    s0 = shards[0]
    return Resumed(s0["step"], s0["wall"], s0["train_time"], d, True, mine.get("run_state", {}))


def check_outer_shard(d: Path, cfg: TrainConfig, outer: dict[str, Any] | None) -> None:
    """A checkpoint with outer state resumes with an outer optimizer, and one without it
    without one: the replicas of a mid-interval checkpoint differ between workers."""
    if cfg.outer != "none" and outer is None:
        raise CheckpointError(f"{d} was saved without an outer optimizer; this run has "
                              f"outer={cfg.outer}: resume with outer=none")
    if cfg.outer == "none" and outer is not None:
        raise CheckpointError(f"{d} holds an outer optimizer's state; this run has outer=none: "
                              "resume with the run's outer settings (between syncs the workers' "
                              "replicas differ, and plain data parallelism would keep them apart)")


def _reshard_optimizer(d: Path, shards: list[dict[str, Any]], model: torch.nn.Module,
                       opt: torch.optim.Optimizer, regather: Any) -> None:
    """Carry the optimizer's per-parameter state over by parameter name."""
    saved = shards[0]["optimizer"]
    if "onebit" in saved:
        same_layout = [len(g) for g in shards[0]["optimizer_param_names"]] == [
            len(g["params"]) for g in opt.param_groups]
        if same_layout and not expert_names(model):
            load_optimizer_state(opt, saved)  # buckets match; the compressor resets itself
            return
        warnings.warn(f"{d}: 1-bit optimizer state cannot follow experts to new ranks yet; "
                      "it restarts from its warm-up", stacklevel=3)
        return
    per_name: list[dict[str, dict[str, Any]]] = []
    for s in shards:
        flat = [n for g in s["optimizer_param_names"] for n in g]
        per_name.append({flat[int(i)]: st for i, st in s["optimizer"]["state"].items()})
    params = dict(model.named_parameters())
    for name, st0 in per_name[0].items():
        p = params[name]
        new = {}
        for key, v in st0.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                new[key] = regather(name, [pn[name][key] for pn in per_name]).to(p.device)
            else:
                new[key] = v.clone() if isinstance(v, torch.Tensor) else v
        opt.state[p] = new


def trim_metrics(path: Path, step: int) -> None:
    """Drop records past ``step`` (written after the checkpoint we resume from), and a torn
    last line (with a warning naming the file)."""
    if not path.is_file():
        return
    _, lines = metrics.parse_lines(path.read_text(encoding="utf-8", errors="replace"), path)
    keep = []
    for line in lines:
        rec = json.loads(line)
        if rec.get("kind") == "end" or rec.get("step", 0) > step:
            continue
        keep.append(line)
    write_text_atomic("\n".join(keep) + ("\n" if keep else ""), path)
