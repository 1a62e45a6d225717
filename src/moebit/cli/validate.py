"""Launcher-side checks: everything that can fail is checked here, before any rank starts
and before the run folder is created, so a bad setting costs one line and leaves nothing.

Ranks repeat some of these checks (they must), but a user should meet each error here:
world/expert-parallel arithmetic, the device, the corpus against the block size, the run
folder's writability, resources, and the checkpoint a resume would load.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from moebit.checkpoint import MANIFEST, CheckpointError, list_complete, read_manifest, verify
from moebit.cli.args import UsageError
from moebit.comm.outer_groups import outer_layout
from moebit.models.hf.folder import check_folder
from moebit.models.meta import on_meta
from moebit.models.registry import family_of
from moebit.moe import is_expert_param
from moebit.optim import OuterSettings
from moebit.optim.outer_params import check_inner
from moebit.training.config import ConfigError, TrainConfig
from moebit.training.data import Corpus, check_block_size, load_corpus
from moebit.training.setup import make_optimizer, model_blocks, outer_keys
from moebit.training.shard_config import check_layout
from moebit.training.shard_loop import check_kind, shard_config
from moebit.training.state import check_model_config

RANK_BASE_BYTES = 350 << 20  # a rank's own footprint: interpreter, torch, gloo buffers


def world_of(launch: dict[str, Any]) -> int:
    """Ranks in the run, after checking the launch flags (--nproc 0 and friends)."""
    nproc, nnodes = int(launch.get("nproc", 2)), int(launch.get("nnodes", 1))
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1 (got {nproc})")
    if nnodes < 1:
        raise UsageError(f"--nnodes must be >= 1 (got {nnodes})")
    if nnodes > 1 and "rdzv_endpoint" not in launch:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if int(launch.get("max_restarts", 0)) < 0:
        raise UsageError("--max-restarts must be >= 0")
    return nproc * nnodes


def check_parallel(cfg: TrainConfig, world: int) -> None:
    """Expert-parallel arithmetic and each MoE layer's own settings (top-k, divisibility)."""
    if cfg.moe and world % cfg.moe.ep_size:
        raise ConfigError(f"ep_size: {cfg.moe.ep_size} does not divide the world size {world} "
                          "(--nproc x --nnodes)")
    model = cfg.model_config()
    try:
        family_of(model).check(model)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def meta_model(cfg: TrainConfig) -> torch.nn.Module:
    """The run's model on the meta device: shapes only, no storage, no process groups."""
    model = cfg.model_config()
    fam = family_of(model)
    with on_meta():
        return fam.build(fam.with_ep_size(model, 1), device="meta")


def check_outer(cfg: TrainConfig, world: int, nproc: int) -> None:
    """The outer optimizer against the launch and the model, as the ranks would build it:
    the two-level topology (``nproc`` ranks per node), the fragments against the model's
    blocks, the schedule, and that the inner optimizer can be wrapped."""
    if cfg.outer == "none":
        return
    try:
        layout = outer_layout(world, nproc, cfg.outer_group, cfg.moe.ep_size if cfg.moe else 1)
    except ValueError as e:
        raise ConfigError(f"outer_group: {e}") from None
    meta = meta_model(cfg)
    blocks = model_blocks(meta)
    keys = outer_keys(cfg, len(blocks))
    if keys["outer_fragments"] > len(blocks) and cfg.outer_fragment_cut == "blocks":
        raise ConfigError(f"outer_fragments: {keys['outer_fragments']} fragments, but the model "
                          f"has {len(blocks)} blocks of trainable parameters (embeddings, each "
                          "layer, final norm and head); outer_fragment_cut=even cuts inside them")
    try:
        OuterSettings(*(keys[k] for k in ("outer_every", "outer_lr", "outer_momentum",
                                          "outer_nesterov", "outer_compress", "outer_fragments",
                                          "outer_delay", "outer_alpha", "outer_int8_block",
                                          "outer_onebit_block", "outer_fragment_cut")))
        params = [p for b in blocks for p in b]
        check_inner(make_optimizer(cfg, [{"params": params}]), params, None)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"outer ({cfg.outer} around optimizer={cfg.optimizer}): {e}") from None
    workers = len(layout.outer[0])
    if workers == 1:
        print(f"moebit train: warning: outer={cfg.outer} with outer_group={cfg.outer_group} on "
              f"{world} rank(s), {nproc} per node, is one worker: nothing to average between "
              "workers (outer_group=world makes every rank a worker)", file=sys.stderr)


def check_shard(cfg: TrainConfig, world: int, nproc: int) -> None:
    """The sharded layout against the launch: the mesh (hsdp: ``nproc`` ranks per node)
    and, with expert parallelism, each MoE layer's local experts over efsdp."""
    if cfg.shard == "none":
        return
    model = cfg.model_config()
    pattern = family_of(model).pattern(model)
    sc = shard_config(cfg)
    sc.local_world_size = nproc
    try:
        for experts in sorted(set(pattern.experts)) or [0]:
            local = experts // pattern.ep_size if experts and pattern.ep_size > 1 else None
            check_layout(sc, world, pattern.ep_size, local)
    except ValueError as e:
        raise ConfigError(f"shard: {e} (--nproc {nproc} x --nnodes {world // nproc})") from None


def check_outer_resume(d: Path, cfg: TrainConfig, world: int) -> None:
    """A DiLoCo checkpoint resumes with the same outer mode, world size and ep size."""
    manifest = read_manifest(d)
    saved = manifest.get("config", {}).get("outer", "none")
    if saved != cfg.outer:
        raise ConfigError(f"outer: {d} was saved with outer={saved}, this run has "
                          f"outer={cfg.outer}; resume with the run's own outer settings")
    if cfg.outer == "none":
        return
    ep = cfg.moe.ep_size if cfg.moe else 1
    if (manifest["world_size"], manifest["ep_size"]) != (world, ep):
        raise ConfigError(f"outer: {d} was saved on {manifest['world_size']} ranks with ep_size "
                          f"{manifest['ep_size']}; a run with outer={cfg.outer} resumes on the "
                          f"same (now {world} ranks, ep_size {ep}): theta_sync is per rank")
    for key in ("outer_every", "outer_fragments", "outer_delay", "outer_compress",
                "outer_group"):
        was = manifest["config"].get(key)
        if was != getattr(cfg, key):
            raise ConfigError(f"{key}: {d} was saved with {key}={was!r}, this run has "
                              f"{getattr(cfg, key)!r}: the outer schedule cannot change mid-run")


def check_device(cfg: TrainConfig, nproc: int) -> None:
    if cfg.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but CUDA is not available here (a CPU "
                          "build of torch, or no visible GPU); use --device cpu or auto")
    if nproc > torch.cuda.device_count():
        raise ConfigError(f"device: --nproc {nproc} ranks need {nproc} GPUs, "
                          f"{torch.cuda.device_count()} visible")


def check_corpus(cfg: TrainConfig) -> Corpus | None:
    """Load a user corpus once here (the default stdlib corpus is known to be large)."""
    if cfg.data is None:
        return None
    corpus = load_corpus(cfg.data, encoding=cfg.encoding, errors=cfg.encoding_errors,
                         allow_skipped=cfg.allow_skipped)
    check_block_size(corpus, cfg.model.block_size)
    return corpus


def check_run_dir(run_dir: Path) -> None:
    """The folder, or the nearest existing folder above it, must be writable."""
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"--run-dir {str(run_dir)!r} is not writable: {probe} is a file")
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only or not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only filesystem" if read_only else "permission denied"
        raise UsageError(f"--run-dir {str(run_dir)!r} is not writable: {probe}: {why}")


def estimate_rank_bytes(cfg: TrainConfig, world: int) -> int:
    """A rough upper bound of one rank's memory: weights, gradients and two optimizer
    moments in fp32, plus activations; experts split over ep_size. The parameters are
    counted exactly, on a model built on the meta device (no storage)."""
    model = cfg.model_config()
    fam = family_of(model)
    pattern = fam.pattern(model)
    with on_meta():  # shapes only: no storage, no process groups
        meta = fam.build(fam.with_ep_size(model, 1), device="meta")
    experts = sum(p.numel() for p in meta.parameters() if is_expert_param(p))
    params = sum(p.numel() for p in meta.parameters()) - experts + experts // pattern.ep_size
    # activations: about 20 d + 3 d_ffn floats per token and layer (d_ffn ~ 4 d), kept for
    # the backward pass
    head = getattr(meta, "lm_head", None)
    d = head.in_features if isinstance(head, torch.nn.Linear) else 1024
    activations = cfg.batch_size * model.block_size * 32 * d * pattern.num_layers * 4
    shards = world if cfg.shard != "none" else 1  # FSDP splits weights, grads, Adam state
    return RANK_BASE_BYTES + int(params * 16 / shards + activations)


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_resources(cfg: TrainConfig, nproc: int, force: bool) -> None:
    """Refuse (unless --force) ranks far beyond the cores, or more memory than is free."""
    if force:
        return
    cores = os.cpu_count() or 1
    if cfg.device != "cuda" and nproc > max(4, 2 * cores):
        raise UsageError(f"--nproc {nproc} ranks on {cores} CPU cores: each rank loads torch and "
                         "its own model copy; use fewer ranks, or add --force")
    need, free = nproc * estimate_rank_bytes(cfg, nproc), mem_available()
    if free is not None and need > free:
        raise UsageError(f"--nproc {nproc} ranks need about {need / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB is available; use fewer ranks or a smaller "
                         "model, or add --force")


def check_run(cfg: TrainConfig, launch: dict[str, Any]) -> Corpus | None:
    """The checks every launched run needs, in the order a user would fix them; returns
    the corpus when a user corpus was loaded (for its summary line)."""
    world = world_of(launch)
    nproc = int(launch.get("nproc", 2))
    check_device(cfg, nproc)
    check_parallel(cfg, world)
    check_outer(cfg, world, nproc)
    check_shard(cfg, world, nproc)
    check_resources(cfg, nproc, bool(launch.get("force")))
    check_run_dir(Path(cfg.run_dir or "runs"))
    if cfg.init_from:  # weights and tokenizer too, not only config.json: no rank meets them first
        check_folder(cfg.init_from, tokenizer="optional")
    return check_corpus(cfg)


def newest_intact(run_dir: Path, below: Path | None = None) -> Path | None:
    """The newest complete checkpoint (older than ``below``) whose shards all verify."""
    for d in reversed(list_complete(run_dir)):
        if below is not None and d.name >= below.name:
            continue
        try:
            verify(d, read_manifest(d))
        except CheckpointError:
            continue
        return d
    return None


def check_resume(run_dir: Path, cfg: TrainConfig, chosen: Path | None) -> Path:
    """The checkpoint a resume will load, verified: manifest, model, expert layout, shards.

    A corrupt newest checkpoint is one line naming the bad file and the newest intact one,
    with the command that resumes from it.
    """
    complete = list_complete(run_dir)
    d = chosen or (complete[-1] if complete else None)
    if d is None:
        raise CheckpointError(f"--resume {run_dir}: the run has no complete checkpoint")
    if not (d / MANIFEST).is_file():
        raise CheckpointError(f"--resume {d}: not a complete checkpoint (no {MANIFEST})")
    try:
        manifest = read_manifest(d)
        verify(d, manifest)
    except CheckpointError as e:
        good = newest_intact(run_dir, below=d)
        hint = (f"; the newest intact checkpoint is {good}: resume from it with "
                f"moebit train --resume {good}" if good else "; no earlier intact checkpoint")
        raise CheckpointError(f"{e}{hint}") from None
    check_model_config(manifest, cfg.model_config().to_dict(), d)
    check_kind(d, manifest, cfg)
    return d
