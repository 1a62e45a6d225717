"""``moebit eval``: validation loss of trained runs on the whole validation split.

    moebit eval runs/moe runs/prmoe                  # every byte of the split, once
    moebit eval runs/a --batches 64 --json val.json  # the first 64 batches of it
    moebit eval runs/a --as-trained                  # the windows training evaluated on
    moebit eval runs/moe-s1 runs/moe-s2 runs/pr-s1 runs/pr-s2 --plot seeds.png

Training evaluates on a few random windows chosen by the run's seed, so two runs with
different seeds are scored on different text. This command scores every run on the same
text: consecutive windows covering the split (each byte is a target exactly once), in
one process, with expert-parallel checkpoints regathered onto it. ``--as-trained`` uses
the run's own windows instead and reproduces its last logged validation loss.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moebit.checkpoint import CheckpointError, read_manifest
from moebit.inference.loading import load_model, resolve_checkpoint
from moebit.models.hf.tokens import TOKENIZER_FILE
from moebit.runs.plots import pyplot
from moebit.runs.units import bits_per_byte, loss_unit, unit_name
from moebit.training.data import load_corpus, val_batches
from moebit.training.evaluation import evaluate
from moebit.training.tokenized import corpus_for_model

USAGE_ERRORS = (CheckpointError, ValueError, OSError)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN_OR_CHECKPOINT",
                    help="run folders (their newest checkpoint) or RUN/checkpoints/step-N")
    ap.add_argument("--batches", type=int, default=0,
                    help="evaluate the first N batches of the split (default 0: all of it)")
    ap.add_argument("--batch-size", type=int, default=0,
                    help="windows per batch (default: the run's batch size, as in training; "
                         "an MoE layer's capacity depends on it)")
    ap.add_argument("--as-trained", action="store_true",
                    help="the run's own validation windows (seed, eval_batches) instead")
    ap.add_argument("--dtype", choices=("run", "fp32", "bf16"), default="run",
                    help="autocast as the run trained (default), or force one")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--plot", metavar="PNG",
                    help="also draw each run's validation loss (one dot per run, grouped by the "
                         "run folder's name without a trailing -sSEED) to this image")
    return ap


def split_windows(data: Any, block_size: int, batch_size: int,
                  max_batches: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive, non-overlapping windows over ``data``: every byte but the first is a
    target once. The last batch may hold fewer windows."""
    t = torch.from_numpy(data)
    n = (len(t) - 1) // block_size
    if n < 1:
        raise ValueError(f"the validation split ({len(t)} bytes) is shorter than one window "
                         f"of block_size {block_size} + 1")
    x = t[: n * block_size].view(n, block_size).long()
    y = t[1 : n * block_size + 1].view(n, block_size).long()
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]
    return batches[:max_batches] if max_batches else batches


def evaluate_run(path: str, batches: int = 0, batch_size: int = 0, as_trained: bool = False,
                 dtype: str = "run") -> dict[str, Any]:
    """Load one run's checkpoint and score it; returns the numbers of one table row."""
    ckpt = resolve_checkpoint(path)
    manifest = read_manifest(ckpt)
    run_cfg = manifest.get("config")
    if not isinstance(run_cfg, dict):
        raise CheckpointError(f"{ckpt} holds no training config: cannot tell its corpus")
    model = load_model(ckpt)
    block = model.config.block_size
    bsz = batch_size or int(run_cfg["batch_size"])
    corpus = load_corpus(run_cfg.get("data"), run_cfg.get("encoding", "utf-8"),
                         run_cfg.get("encoding_errors", "strict"))
    unit = loss_unit(len(corpus.val), len(corpus.val), None)
    # a model from a folder reads its tokenizer's ids (cached); moebit's GPT reads bytes
    text = corpus
    corpus = corpus_for_model(corpus, run_cfg.get("init_from"), model.config.vocab_size)
    if corpus is not text:  # the loss is per token; bits/byte from the val text
        unit = loss_unit(len(text.val), len(corpus.val),
                         str(Path(run_cfg["init_from"]) / TOKENIZER_FILE))
    if as_trained:
        wins = val_batches(corpus.val, block, int(run_cfg["batch_size"]),
                           batches or int(run_cfg["eval_batches"]), int(run_cfg["seed"]))
    else:
        wins = split_windows(corpus.val, block, bsz, batches)
    use = run_cfg.get("dtype", "fp32") if dtype == "run" else dtype
    bar = tqdm(wins, desc=Path(path).name, unit="batch", file=sys.stderr, mininterval=1.0,
               leave=False)
    val = evaluate(model, bar, use, torch.device("cpu"))
    n_windows = sum(len(x) for x, _ in wins)
    n_params = sum(p.numel() for p in model.parameters())
    return {"run": str(path), "checkpoint": str(ckpt), "step": manifest.get("step"),
            "n_params": n_params, "val_loss": val, "bits_per_byte": bits_per_byte(val, unit),
            "windows": n_windows, "targets": n_windows * block, "dtype": use,
            "as_trained": as_trained, "unit": unit_name(unit), **unit}


def _relative(r: dict[str, Any], first: dict[str, Any]) -> float:
    """The loss against the first row's: in bits/byte where the units differ (per token
    of another tokenizer is not comparable), NaN where that is unknown."""
    if (r["unit"], r.get("tokenizer")) == (first["unit"], first.get("tokenizer")):
        return r["val_loss"] / first["val_loss"] - 1
    if r["bits_per_byte"] is None or first["bits_per_byte"] is None:
        return math.nan
    return r["bits_per_byte"] / first["bits_per_byte"] - 1


def plot_rows(rows: list[dict[str, Any]], path: str) -> None:
    """One row per model, one dot per seed, the mean as a bar: seed noise next to the gaps.

    Runs are grouped by their folder name with a trailing ``-s<seed>`` removed, so
    ``moe8-s7`` and ``moe8-s1337`` are two seeds of ``moe8``.
    """
    groups: dict[str, list[float]] = {}
    for r in rows:
        name = re.sub(r"-s\d+$", "", Path(r["run"].rstrip("/")).name)
        groups.setdefault(name, []).append(r["val_loss"])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(groups) + 1.2))
    for i, vals in enumerate(groups.values()):
        mean = sum(vals) / len(vals)
        ax.plot(vals, [i] * len(vals), "o", color="C0", alpha=0.6)
        ax.plot([mean, mean], [i - 0.3, i + 0.3], color="C3", lw=2)
        ax.annotate(f"mean {mean:.4f}", (mean, i - 0.3), xytext=(3, 0), textcoords="offset points",
                    ha="left", va="top", fontsize=8, color="C3")
    ax.set_yticks(range(len(groups)), list(groups))
    ax.invert_yaxis()
    units = sorted({r["unit"] for r in rows})
    ax.set_xlabel(f"validation loss, {' or '.join(units)} (dots: runs; bar: their mean)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.batches < 0 or args.batch_size < 0 or args.threads < 0:
        print("moebit eval: --batches, --batch-size and --threads must be >= 0", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, failed = [], 0
    for run in args.runs:  # one bad run must not throw away the others' results
        try:
            rows.append(evaluate_run(run, args.batches, args.batch_size, args.as_trained,
                                     args.dtype))
        except USAGE_ERRORS as e:
            failed += 1
            print(f"moebit eval: {run}: {e}", file=sys.stderr)
    if not rows:
        return 2
    width = max(len(r["run"]) for r in rows)
    print(f"{'run':<{width}}  {'step':>6}  {'params':>9}  {'val loss':>9}  {'unit':<10}  "
          f"{'bits/byte':>9}  {'vs first':>8}  windows")
    for r in rows:
        rel = _relative(r, rows[0])
        bpb = f"{r['bits_per_byte']:9.4f}" if r["bits_per_byte"] is not None else f"{'?':>9}"
        print(f"{r['run']:<{width}}  {r['step']:>6}  {r['n_params']:>9,}  {r['val_loss']:9.4f}  "
              f"{r['unit']:<10}  {bpb}  {rel:+8.2%}  {r['windows']}")
    for tok in sorted({r["tokenizer"] for r in rows if r.get("tokenizer")}):
        print(f"(nats/token: per token of {tok})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot_rows(rows, args.plot)
        print(f"plot: {args.plot}")
    if failed:
        print(f"moebit eval: {failed} of {len(args.runs)} runs could not be evaluated (see above)",
              file=sys.stderr)
    return 2 if failed else 0

