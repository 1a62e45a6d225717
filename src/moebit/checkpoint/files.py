"""Atomic, code-free checkpoint files.

A save writes a temporary file in the target folder, fsyncs it, renames it over the
target and fsyncs the folder: a crash mid-save leaves the previous file whole. Loading
uses ``torch.load(weights_only=True)``, which never unpickles code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupted, or of another kind."""


def save_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_text_atomic(text: str, path: str | os.PathLike[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_file(path: str | os.PathLike[str]) -> Any:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for bad archives
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupted: {e}") from e


# ---------------------------------------------------------------------------------------
# Sharded training checkpoints: one file per rank plus a manifest that commits them.
#
#   RUN/checkpoints/step-00000100/rank-00000.pt ... rank-0000N.pt
#   RUN/checkpoints/step-00000100/manifest.json   (written last: its presence = complete)
# ---------------------------------------------------------------------------------------

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_of(path: str | os.PathLike[str]) -> str:

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def step_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def write_manifest(ckpt_dir: Path, manifest: dict[str, Any]) -> None:

    manifest = {"format": FORMAT_VERSION, **manifest}
    write_text_atomic(json.dumps(manifest, indent=2) + "\n", ckpt_dir / MANIFEST)


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:

    path = ckpt_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir} has no {MANIFEST}: the save did not complete") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest


def verify(ckpt_dir: Path, manifest: dict[str, Any]) -> None:
    """Check every shard against the manifest's size and SHA-256; name the bad file."""
    for name, meta in manifest["files"].items():
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered: {size} bytes, "
                f"the manifest says {meta['bytes']}"
            )
        if sha256_of(path) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupted: checksum mismatch")


def list_complete(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint folders of a run that have a manifest, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / MANIFEST).is_file())


def latest(run_dir: str | os.PathLike[str]) -> Path | None:
    found = list_complete(run_dir)
    return found[-1] if found else None


def prune(run_dir: str | os.PathLike[str], keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (and stale partial ones)."""

    complete = list_complete(run_dir)
    newest = complete[-1] if complete else None
    for p in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(p, ignore_errors=True)
    root = Path(run_dir) / "checkpoints"
    if root.is_dir() and newest is not None:
        for p in root.glob("step-*"):
            if not (p / MANIFEST).exists() and p.name < newest.name:
                shutil.rmtree(p, ignore_errors=True)


def remove_incomplete(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete every step folder without a manifest (the debris of a failed save).

    Only for the launcher, once no rank of the run is alive: a live rank may be writing one.
    """
    import shutil

    root = Path(run_dir) / "checkpoints"
    gone = [p for p in root.glob("step-*") if not (p / MANIFEST).exists()] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
