"""``moebit export``: a run trained ``--init-from`` a Hugging Face folder, back to one.

    moebit export runs/ft --to exported/        # newest checkpoint -> config.json + safetensors
    moebit export runs/ft/checkpoints/step-00000200 --to exported/

The checkpoint's experts (whatever expert-parallel degree it was saved with) are gathered
in this one process and written with ``moebit.hf.save_pretrained``; the source folder's
tokenizer and generation files are copied along, so transformers and ``moebit generate``
load the result as they loaded the original.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from moebit.checkpoint import read_manifest
from moebit.inference.loading import load_model, resolve_checkpoint
from moebit.models.registry import family_of

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT")
    ap.add_argument("--to", required=True, metavar="HF_DIR", help="the folder to write")
    return ap


def export(checkpoint: str | Path, to: str | Path) -> Path:
    """Write the checkpoint's model as a Hugging Face folder; returns the folder."""
    d = resolve_checkpoint(checkpoint)
    model = load_model(d)
    try:
        out = family_of(model.config).save_folder(model, Path(to))
    except ValueError as e:
        raise ValueError(f"{d}: {e}") from None
    init = (read_manifest(d).get("config") or {}).get("init_from")
    for name in COPIED:
        src = Path(init) / name if init else None
        if src is not None and src.is_file():
            shutil.copyfile(src, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = export(args.checkpoint, args.to)
    print(f"moebit export: wrote {out}")
    return 0
