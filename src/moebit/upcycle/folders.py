"""Sparse upcycling of a model folder (a dense Hugging Face folder into its MoE family),
for every family that has a folder form.

The family writes the MoE folder (``ModelFamily.upcycle_folder``: its config and
weights, experts copying the dense MLPs through ``moebit.models.upcycling``); this front
end makes the write atomic: into a hidden folder beside ``out``, renamed at the end, so
an interrupted upcycle leaves no folder that looks like a complete model (or blocks the
next try).

    upcycle_folder("llama-dense/", "mixtral-up/", UpcycleSpec(num_experts=8))
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moebit.models.registry import families, family_of_folder
from moebit.models.upcycling import UpcycleSpec


def is_model_folder(path: str | Path) -> bool:
    """A model folder (a config.json naming a ``model_type``), of a known family or not; a
    moebit run folder has checkpoints/ instead."""
    p = Path(path)
    if family_of_folder(p) is not None:
        return True
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "model_type" in cfg and not (p / "checkpoints").exists()


def upcycle_folder(src: str | Path, out: str | Path, spec: UpcycleSpec) -> tuple[Path, str]:
    """Write the upcycled MoE model of the dense model folder ``src`` to ``out`` (a new or
    empty folder). Returns ``out`` and the MoE family's name."""
    src, out = Path(src), Path(out)
    fam = family_of_folder(src)
    if fam is None:
        try:
            mt = json.loads((src / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            mt = None
        names = ", ".join(f.name for f in families() if f.name != "gpt")
        if mt is not None:
            raise ValueError(f"upcycle: model_type {mt!r} cannot be upcycled: no model family "
                             f"reads it (families: {names})")
        raise ValueError(f"upcycle: {src} is not a model folder (config.json with a "
                         "model_type, and safetensors weights)")
    if out.resolve() == src.resolve() or (out.exists() and any(out.iterdir())):
        raise ValueError(f"upcycle: the output folder {out} is not empty: pick a new one")
    tmp = out.parent / f".{out.name}.upcycle-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        name = fam.upcycle_folder(src, tmp, spec)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, name
