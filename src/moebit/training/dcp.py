"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own
shards, nothing is gathered to one rank, and a checkpoint loads at any world size.

    save_sharded(step_dir(run, 100), model, opt, extra={"step": 100})   # every rank
    extra = load_sharded(step_dir(run, 100), model, opt)                  # any world size
    weights = full_state_dict(model)       # rank 0: the whole model, for export; else {}

A save is atomic: DCP writes into ``.step-N.tmp`` beside the target; each rank hashes
the files it wrote (SHA-256), rank 0 writes the manifest (``moebit.checkpoint.files``'s
format, ``"kind": "dcp"``) and renames the folder into place, so a folder under its
final name is always complete. A load first checks every file against the manifest
(the ranks share the hashing) and names the bad file. The folder must be on a file
system that every rank sees (as DCP itself requires).

Experts: a rank holds a shard (over efsdp) of its ep rank's local experts [E_local, ...].
In the checkpoint each stacked expert tensor is stored as the global [E, ...] tensor,
row-sharded over the ``experts_rows`` mesh (ep rank, then efsdp rank), so loading
reshards over a different world size or ep size like any other tensor. DCP places
shards by mesh coordinates only; gathering goes through FSDP's and the ep groups.

With ``rs_compress="int8"`` each rank also saves its error-feedback residuals
(``residuals-rank-N.pt``, in the manifest); they are restored on the same topology
(world, shard mode, ep size), so an int8 run resumes bit-exact too, and restart at
zero on another one.

Independent node replicas (``node_local``: fsdp under an outer optimizer, the nodes
drifting apart between syncs): node 0 saves under the usual keys, so export and a plain
fsdp load read its model, and node n > 0 under ``outer_replica{n}.``; DCP would otherwise
keep one node's shards of what looks like one replicated tensor. Such a checkpoint resumes
on the same nodes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from moebit.checkpoint.files import (
    CheckpointError,
    load_file,
    read_manifest,
    save_atomic,
    sha256_of,
    verify,
    write_manifest,
)
from moebit.training.sharding import ShardState

KIND = "dcp"


def _state(model: nn.Module) -> ShardState:
    st = getattr(model, "moebit_shard", None)
    if st is None:
        raise ValueError("DCP checkpoints need a model sharded with moebit.training.sharding."
                         "shard_model (it has no moebit_shard)")
    return st


def _as_rows(t: Any, st: ShardState) -> Any:
    """An expert DTensor on its efsdp mesh as a shard of the global [E, ...] tensor."""
    if not isinstance(t, DTensor) or st.meshes.experts_rows is None:
        return t
    mesh = st.meshes.experts_rows
    shape = (t.shape[0] * st.meshes.ep_size, *t.shape[1:])
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    return DTensor.from_local(t.to_local(), mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _checkpoint_view(model: nn.Module, msd: dict[str, Any],
                     osd: dict[str, Any] | None) -> dict[str, Any]:
    """The state DCP saves and loads in place: the model's and the optimizer's sharded
    state dicts with expert tensors viewed as global row shards (sharing storage)."""
    st = _state(model)
    experts = set(st.expert_names)
    view: dict[str, Any] = {"model": {k: _as_rows(v, st) if k in experts else v
                                      for k, v in msd.items()}}
    if osd is not None:
        state = {k: ({n: _as_rows(v, st) for n, v in s.items()} if k in experts else s)
                 for k, s in osd["state"].items()}
        # process groups (an outer optimizer's inner groups) are the run's, not state
        groups = [{k: v for k, v in g.items() if k != "process_group"}
                  for g in osd["param_groups"]]
        view["optim"] = {"state": state, "param_groups": groups}
    return {replica_key(st): view} if st.meshes.replica else view


def replica_key(st: ShardState) -> str:
    """The top-level key of a node replica's state (``node_local``, node > 0)."""
    return f"outer_replica{st.meshes.replica}"


def _own(view: dict[str, Any], st: ShardState) -> dict[str, Any]:
    """This rank's part of ``_checkpoint_view`` (under its replica key for node > 0)."""
    return view[replica_key(st)] if st.meshes.replica else view


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    msd = get_model_state_dict(model)
    osd = None if optimizer is None else get_optimizer_state_dict(model, optimizer)
    return msd, osd


def _tmp_dir(ckpt_dir: Path) -> Path:
    return ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")


def _residual_file(rank: int) -> str:
    return f"residuals-rank-{rank:05d}.pt"


def rank_state_file(rank: int) -> str:
    """The per-rank file of ``save_sharded(rank_state=...)`` (RNG, data position)."""
    return f"rank-state-{rank:05d}.pt"


def load_rank_state(ckpt_dir: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    """This rank's ``rank_state`` of a verified checkpoint, or None when the save had no
    rank ``rank`` (another world size) or kept none."""
    path = Path(ckpt_dir) / rank_state_file(rank)
    return load_file(path) if path.is_file() else None


def _save_residuals(folder: Path, st: ShardState, rank: int) -> None:
    """This rank's int8 error-feedback residuals, one per unit (None before the first
    backward): a plain per-rank file, valid only on the same topology."""
    if st.config.rs_compress == "int8":
        save_atomic([rs.residual for rs in st.reduce_scatters], folder / _residual_file(rank))


def _load_residuals(folder: Path, st: ShardState, manifest: dict[str, Any], rank: int) -> bool:
    """Restore the residuals when world, shard mode and ep size are those of the save;
    else they restart at zero (one step's quantization error is dropped). Returns
    whether they were restored."""
    here = (dist.get_world_size(), st.config.shard, st.meshes.ep_size)
    saved = (manifest.get("world_size"), manifest.get("shard"), manifest.get("ep_size"))
    path = folder / _residual_file(rank)
    if st.config.rs_compress != "int8" or here != saved or not path.is_file():
        return False
    residuals = load_file(path)
    if len(residuals) != len(st.reduce_scatters):
        raise CheckpointError(f"{path} holds {len(residuals)} residuals for "
                              f"{len(st.reduce_scatters)} sharded units")
    for rs, r in zip(st.reduce_scatters, residuals, strict=True):
        rs.residual = r
    return True


def _my_files(folder: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the files this rank wrote (``__{rank}_*`` and its residuals);
    rank 0 also takes the rest (``.metadata``)."""
    out = {}
    for path in sorted(folder.iterdir()):
        mine = path.name.startswith(f"__{rank}_") or path.name in (_residual_file(rank),
                                                                     rank_state_file(rank))
        others = path.name.startswith(("__", "residuals-rank-", "rank-state-"))
        if mine or (rank == 0 and not others):
            out[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    return out


def save_sharded(ckpt_dir: str | os.PathLike[str], model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None, *,
                 rank_state: dict[str, Any] | None = None,
                 fields: dict[str, Any] | None = None) -> Path:
    """Save the model (and optimizer) shards of every rank into ``ckpt_dir``; collective.

    ``extra`` (JSON values: step, data position, ...) is kept in the manifest, and
    ``fields`` (JSON) at its top level (the loop's step, model config and config, so
    the folder reads like its other checkpoints); ``rank_state`` (torch.save-able: RNG,
    data position) is this rank's own file, hashed like the rest. An existing folder of
    the same name is replaced only once the new one is complete.
    """
    ckpt_dir = Path(ckpt_dir)
    st = _state(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = _tmp_dir(ckpt_dir)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_checkpoint_view(model, *_state_dicts(model, optimizer)), checkpoint_id=tmp)
    _save_residuals(tmp, st, rank)
    if rank_state is not None:
        save_atomic(rank_state, tmp / rank_state_file(rank))
    dist.barrier()  # every rank's files are complete before any rank lists the folder
    files: list[dict[str, dict[str, Any]] | None] = [None] * world
    dist.all_gather_object(files, _my_files(tmp, rank))
    if rank == 0:
        listing = {k: v for part in files for k, v in (part or {}).items()}
        write_manifest(tmp, {**(fields or {}), "kind": KIND, "world_size": world, "shard": st.config.shard,
                             "ep_size": st.meshes.ep_size, "optimizer": optimizer is not None,
                             "extra": extra or {}, "files": listing})
        _replace_dir(tmp, ckpt_dir)
    dist.barrier()
    return ckpt_dir


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (moving an older ``final`` aside first), then fsync."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


def verify_sharded(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every file against the manifest, the ranks sharing the hashing; collective.

    Returns the manifest; raises CheckpointError naming the first bad file on every rank.
    """
    ckpt_dir = Path(ckpt_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    try:
        manifest = read_manifest(ckpt_dir)
        if manifest.get("kind") != KIND:
            raise CheckpointError(f"{ckpt_dir} is not a DCP checkpoint (kind "
                                  f"{manifest.get('kind')!r}): load it with moebit.training.state")
        names = sorted(manifest["files"])[rank::world]
        verify(ckpt_dir, {"files": {n: manifest["files"][n] for n in names}})
    except CheckpointError as e:
        error = str(e)
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    bad = next((e for e in errors if e), None)
    if bad:
        raise CheckpointError(bad)
    return manifest


def load_sharded(ckpt_dir: str | os.PathLike[str], model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a ``save_sharded`` folder into the sharded ``model`` (and ``optimizer``) at
    this world size, after verifying it; collective. Returns the manifest's ``extra``."""
    manifest = verify_sharded(ckpt_dir)
    if optimizer is not None and not manifest.get("optimizer"):
        raise CheckpointError(f"{ckpt_dir} holds no optimizer state (saved without one)")
    msd, osd = _state_dicts(model, optimizer)
    view = _checkpoint_view(model, msd, osd)
    dcp.load(view, checkpoint_id=Path(ckpt_dir))
    # Tensors were loaded in place (the views share storage with msd/osd); values that
    # are not tensors were set in the view's containers: copy the experts' ones back.
    set_model_state_dict(model, msd)
    if osd is not None:
        own = _own(view, _state(model))
        for key in _state(model).expert_names:
            for name, value in own["optim"]["state"].get(key, {}).items():
                if not isinstance(value, torch.Tensor):
                    osd["state"][key][name] = value
        pgs = [g.get("process_group") for g in optimizer.param_groups]
        osd["param_groups"] = own["optim"]["param_groups"]  # as loaded, no process groups
        set_optimizer_state_dict(model, optimizer, osd)
        for g, pg in zip(optimizer.param_groups, pgs, strict=True):
            if pg is not None:
                g["process_group"] = pg
    _load_residuals(Path(ckpt_dir), _state(model), manifest, dist.get_rank())
    return dict(manifest.get("extra", {}))


def _full_experts(t: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """The global [E, ...] expert tensor: gathered over efsdp (FSDP's mesh), then over the
    ep group in ep-rank order. (The rows mesh is only a layout: its process group orders
    ranks by global rank, not by row, so it must not gather.)"""
    local = t.full_tensor() if isinstance(t, DTensor) else t
    groups = getattr(model, "ep_groups", None)
    if groups is None or groups.ep_size == 1:
        return local
    out = local.new_empty((groups.ep_size * local.shape[0], *local.shape[1:]))
    dist.all_gather_single(out, local.contiguous(), group=groups.ep_group)
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on rank 0 (CPU tensors, experts as global [E, ...]),
    ``{}`` on the other ranks; collective (one tensor gathered at a time)."""
    experts = set(_state(model).expert_names)
    out: dict[str, torch.Tensor] = {}
    for key, value in get_model_state_dict(model).items():
        if key in experts:
            value = _full_experts(value, model)
        elif isinstance(value, DTensor):
            value = value.full_tensor()
        if dist.get_rank() == 0:
            out[key] = value.detach().cpu().clone()
    return out
