"""``moebit export``: a run trained ``--init-from`` a Hugging Face folder, back to one.

    moebit export runs/ft --to exported/        # newest checkpoint -> config.json + safetensors
    moebit export runs/ft/checkpoints/step-00000200 --to exported/
    moebit export runs/ft --to exported/ --overwrite   # replace an earlier export

The checkpoint's experts (whatever expert-parallel degree it was saved with) are gathered
in this one process and written with ``moebit.hf.save_pretrained``; the source folder's
tokenizer, chat template and generation files are copied along, so transformers and
``moebit generate`` load the result as they loaded the original.

The folder must be new or empty: a non-empty one is refused, since an old
``model.safetensors`` left beside the new shards is what transformers would load.
``--overwrite`` replaces the model files of an existing folder (config.json, weights in
any format, tokenizer and generation files) and keeps the others (a README, a licence).
The new folder is written beside it and swapped in by renames, so an interrupted export
leaves the old folder whole (or, at worst, as ``.NAME.export-old`` next to it).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from moebit.checkpoint import read_manifest
from moebit.inference.loading import load_model, resolve_checkpoint
from moebit.models.hf.folder import copy_side_files, model_files
from moebit.models.registry import family_of


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT")
    ap.add_argument("--to", required=True, metavar="HF_DIR", help="the folder to write")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the model files of an existing, non-empty HF_DIR")
    return ap


def check_target(out: Path, overwrite: bool, checkpoint: Path) -> None:
    """Refuse a target that is a file, a moebit run (or inside one), or a non-empty
    folder without ``--overwrite``."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--to {str(out)!r} is a file, not a folder")
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint
    here = out.resolve()
    if here == run.resolve() or run.resolve() in here.parents or (out / "checkpoints").is_dir():
        raise ValueError(f"--to {str(out)!r} is (inside) a moebit run folder: export into a "
                         "folder of its own")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        present = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise ValueError(f"--to {str(out)!r} is not empty ({present}, ...): a stale model there "
                         "would be loaded instead of this one; pick a new folder, or add "
                         "--overwrite to replace its model files")


def _swap_in(tmp: Path, out: Path) -> None:
    """Make ``tmp`` the folder ``out``; the old folder's files that are not model files
    move into it, the rest go."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.export-old"
    shutil.rmtree(old, ignore_errors=True)
    replaced = {f.name for f in model_files(out)}
    out.rename(old)
    tmp.rename(out)
    for f in sorted(old.iterdir()):
        if f.name not in replaced and not (out / f.name).exists():
            f.rename(out / f.name)
    shutil.rmtree(old)


def export(checkpoint: str | Path, to: str | Path, overwrite: bool = False) -> Path:
    """Write the checkpoint's model as a Hugging Face folder; returns the folder."""
    d = resolve_checkpoint(checkpoint)
    out = Path(to)
    check_target(out, overwrite, d)
    model = load_model(d)
    init = (read_manifest(d).get("config") or {}).get("init_from")
    # written next to ``out`` and renamed at the end: an interrupted export leaves no
    # folder that looks like a complete model, and never a mix of two
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            family_of(model.config).save_folder(model, tmp)
        except ValueError as e:  # a family that writes no folder (moebit's GPT)
            raise ValueError(f"{d}: {e}") from None
        if init and Path(init).is_dir():
            copy_side_files(init, tmp)
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = export(args.checkpoint, args.to, args.overwrite)
    print(f"moebit export: wrote {out}")
    return 0
