"""A moebit checkpoint's model weights, for any expert-parallel degree.

Expert parameters (``moebit.moe.is_expert_param``, stacked on dim 0 as [E_local, ...])
are concatenated over the saved expert-parallel group and each rank takes its slice, so
a checkpoint saved at one world or ep size loads at another. Used by resume
(``moebit.training.state``) and by inference (``moebit.inference.loading``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from moebit.checkpoint.files import CheckpointError, load_file, shard_name, verify
from moebit.moe import is_expert_param


def expert_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if is_expert_param(p)}


def regatherer(model: torch.nn.Module, d: Path, rank: int, new_ep: int) -> Any:
    """A function (name, per-old-shard tensors) -> this rank's tensor under ``new_ep``."""
    experts = expert_names(model)
    my_ep_rank = rank % new_ep

    def regather(key: str, per_shard: list[torch.Tensor]) -> torch.Tensor:
        if key not in experts:
            return per_shard[0]
        full = torch.cat(per_shard, dim=0)
        if full.shape[0] % new_ep:
            raise CheckpointError(
                f"{d}: {key} holds {full.shape[0]} experts, not divisible by ep_size {new_ep}"
            )
        n = full.shape[0] // new_ep
        return full[my_ep_rank * n : (my_ep_rank + 1) * n].clone()

    return regather


def load_model_weights(d: Path, manifest: dict[str, Any], model: torch.nn.Module, rank: int,
                       ep_size: int) -> list[dict[str, Any]]:
    """Load a checkpoint's weights into ``model`` for expert-parallel rank ``rank % ep_size``.

    Works for any saved and current world/ep sizes: the first saved expert-parallel group
    (ranks 0..ep-1) holds every expert once; each rank takes its slice. Returns the shards
    read (for the optimizer state).
    """
    if manifest.get("kind") == "dcp":
        load_dcp_weights(d, manifest, model, rank, ep_size)
        return []
    names = [shard_name(r) for r in range(manifest["ep_size"])]
    verify(d, {"files": {n: manifest["files"][n] for n in names}})
    shards = [load_file(d / n) for n in names]
    regather = regatherer(model, d, rank, ep_size)
    state = {k: regather(k, [s["model"][k] for s in shards]) for k in shards[0]["model"]}
    model.load_state_dict(state)
    return shards


def load_dcp_weights(d: Path, manifest: dict[str, Any], model: torch.nn.Module, rank: int,
                     ep_size: int) -> None:
    """A sharded run's DCP checkpoint (``moebit.training.dcp``) into an unsharded ``model``
    in this one process: every file verified, the whole tensors read without a process
    group (DCP reassembles the shards of any world size), experts, stored as the global
    [E, ...] tensors, sliced for expert-parallel rank ``rank % ep_size``."""
    verify(d, manifest)
    experts = expert_names(model)
    local = model.state_dict()
    want = {k: torch.empty((v.shape[0] * ep_size, *v.shape[1:]) if k in experts else v.shape,
                           dtype=v.dtype) for k, v in local.items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            import torch.distributed.checkpoint as dcp  # only sharded runs: a second to import

            dcp.load({"model": want}, checkpoint_id=d, no_dist=True)
    except Exception as e:  # DCP raises its own types (CheckpointException, ...) for a mismatch
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{d}: its DCP shards do not hold this model: {first}") from None
    regather = regatherer(model, d, rank, ep_size)
    model.load_state_dict({k: regather(k, [v]) for k, v in want.items()})
