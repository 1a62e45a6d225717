"""``moebit demo``: the one command that shows what moebit does, in about 10 minutes.

Trains a small byte-level LM on the Python standard library with 2 gloo ranks,
then prints the comparison table, where the plots are, and generated text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEMO_MODEL = ["--n-layer", "4", "--n-head", "4", "--d-model", "192", "--block-size", "128",
              "--batch-size", "16", "--lr", "2e-3", "--warmup-steps", "30", "--eval-every", "50"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moebit demo", description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for the demo's runs (default runs/demo-<time>)")
    args = ap.parse_args(argv)
    from moebit.cli import launch_training, parse_train_args
    from moebit.report import report

    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    runs = []
    plan = [("adam", ["--optimizer", "adam"])]
    for name, extra in plan:
        print(f"\n=== demo: {name}, {args.nproc} ranks, {args.steps} steps ===", flush=True)
        cfg, launch = parse_train_args(
            DEMO_MODEL + extra + ["--steps", str(args.steps), "--nproc", str(args.nproc),
                                  "--run-dir", str(out / name)]
        )
        runs.append(launch_training(cfg, launch))
    table, plots = report([str(r) for r in runs], str(out))
    print("\n" + table)
    for p in plots:
        print(f"plot: {p}")
    end = [json.loads(line) for line in (runs[-1] / "metrics.jsonl").read_text().splitlines()][-1]
    print("\nGenerated text (prompt + continuation):")
    for s in end.get("samples", []):
        print("---\n" + s)
    return 0
