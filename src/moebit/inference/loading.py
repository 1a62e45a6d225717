"""A trained model from a run or checkpoint folder, ready for generation or evaluation.

    model = load_model("runs/a")                          # newest complete checkpoint, eval mode
    model = load_model("runs/a/checkpoints/step-00000400", ep_size=2, rank=r)

A bad path is a ``CheckpointError`` saying what was found: a missing folder, a file, a
run with no complete checkpoint, a corrupted shard (named), or another model type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moebit.checkpoint import MANIFEST, CheckpointError, latest, read_manifest
from moebit.checkpoint.weights import load_model_weights
from moebit.models.interface import CausalLM
from moebit.models.registry import family_of, family_of_dict


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder (its newest complete checkpoint) or a checkpoint folder, else a clear error."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    if p.is_file():
        raise CheckpointError(
            f"{p} is a file, not a moebit run or checkpoint folder (expected RUN/ or "
            f"RUN/checkpoints/step-N/ holding {MANIFEST})"
        )
    if (p / MANIFEST).is_file():
        return p
    if (p / "checkpoints").is_dir() or (p / "config.json").is_file():
        d = latest(p)
        if d is None:
            raise CheckpointError(f"run {p} has no complete checkpoint (none with a {MANIFEST})")
        return d
    raise CheckpointError(
        f"{p} is not a moebit run or checkpoint folder: no {MANIFEST}, config.json or checkpoints/"
    )


def init_folder_of(manifest: dict) -> Path | None:
    """The Hugging Face folder a run was trained ``--init-from`` (its manifest's config),
    where its tokenizer lives; None for a run that started from scratch."""
    init = (manifest.get("config") or {}).get("init_from")
    return Path(init) if init else None


def model_config_of(manifest: dict, where: Path) -> Any:
    """The model config saved in a manifest, read by the family it names; another kind of
    checkpoint is named as such."""
    mc = manifest.get("model_config")
    if not isinstance(mc, dict) or "ep_size" not in manifest or "files" not in manifest:
        raise CheckpointError(
            f"{where / MANIFEST} is not a moebit checkpoint (no model_config / ep_size / files)"
        )
    try:
        fam = family_of_dict(mc, str(where / MANIFEST))
    except ValueError as e:
        raise CheckpointError(f"{where} holds another model type: {e}") from None
    try:
        return fam.config_from_dict(mc)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} holds another model type: its model_config does not "
                              f"describe a {fam.name} model ({e})") from None


def load_model(
    path: str | Path, ep_size: int = 1, rank: int = 0, dtype: torch.dtype | None = None
) -> CausalLM:
    """Build the model (of any registered family) a checkpoint was saved from and load its
    weights, in eval mode.

    ``ep_size > 1`` splits every MoE layer's experts over that many ranks (the process
    group must be initialised; call on every rank); this rank keeps the slice of
    ``rank % ep_size``. Raises ``CheckpointError`` naming the problem for a missing,
    incomplete, corrupted or foreign checkpoint.
    """
    d = resolve_checkpoint(path)
    manifest = read_manifest(d)
    cfg = model_config_of(manifest, d)
    fam = family_of(cfg)
    pattern = fam.pattern(cfg)
    if not pattern.is_moe and ep_size > 1:
        raise ValueError(f"{d} holds a dense model: expert parallelism (ep_size {ep_size}) needs experts")
    model = fam.build(fam.with_ep_size(cfg, ep_size))
    try:
        load_model_weights(d, manifest, model, rank, ep_size if pattern.is_moe else 1)
    except KeyError as e:
        raise CheckpointError(f"{d} is not a {fam.name} checkpoint (missing entry {e})") from None
    except RuntimeError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{d} holds weights of another model: {str(e).splitlines()[0]}") from None
    if dtype is not None:
        model.to(dtype)  # type: ignore[attr-defined]
    return model.eval()  # type: ignore[attr-defined]
