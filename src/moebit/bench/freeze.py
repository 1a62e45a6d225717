"""Where should 1-bit Adam freeze its variance? Fixed fractions of the run against "auto".

Trains the same small byte-level GPT (``moebit.models.gpt``) on a slice of the stdlib
corpus on W gloo ranks, once with exactly averaged Adam and once per freeze choice of
OnebitAdam (same seed, data and lr schedule), and reports the final validation loss of
each, where "auto" froze, and the drift of sqrt(v̂) it saw (``moebit.optim.freeze``).

    python -m moebit.bench.freeze                      # 2 ranks, 1200 steps, ~15 min on 2 busy cores
    python -m moebit.bench.freeze --steps 600 --fractions 0.2 --out freeze.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch

from moebit.comm import collectives, stats
from moebit.models.gpt import GPTConfig
from moebit.models.registry import new_model
from moebit.optim import AutoFreeze, OnebitAdam
from moebit.testing import run_on_ranks
from moebit.training.data import TrainBatches, load_corpus, val_batches

FRACTIONS = (0.05, 0.1, 0.2, 0.4)


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine to lr/10 (the schedule of ``moebit train``)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 * lr + 0.45 * lr * (1 + math.cos(math.pi * progress))


def _run_all(rank: int, world: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """On each rank: every configuration in turn, the same seed and data for each."""

    corpus = load_corpus(opts["data"])
    train = corpus.train[: int(opts["data_mb"] * 2**20)]
    vals = val_batches(corpus.val, opts["block_size"], opts["batch_size"], opts["eval_batches"])
    steps = opts["steps"]
    cfg = GPTConfig(
        n_layer=opts["n_layer"], n_head=4, d_model=opts["d_model"], block_size=opts["block_size"]
    )
    results = []
    for choice in opts["choices"]:
        torch.manual_seed(opts["seed"])
        model = new_model(cfg)
        if choice == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=opts["lr"])
        else:
            rule = AutoFreeze(**opts["auto"]) if choice == "auto" else None
            fs = "auto" if choice == "auto" else max(1, round(float(choice) * steps))
            opt = OnebitAdam(model.parameters(), lr=opts["lr"], freeze_step=fs, auto_freeze=rule)
        batches = TrainBatches(train, opts["block_size"], opts["batch_size"], opts["seed"], rank)
        stats.reset()
        drifts: list[tuple[int, float]] = []
        t0 = time.perf_counter()
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, steps, opts["lr"], opts["warmup"])
            x, y = batches.next()
            opt.zero_grad(set_to_none=True)
            model(x, y).loss.backward()
            if choice == "adam":
                collectives.allreduce_mean_([p.grad for p in model.parameters()])
            opt.step()
            rule = getattr(opt, "auto_freeze", None)
            if rule is not None and rule.last_drift is not None and rule.snapshot_step == step + 1:
                drifts.append((step + 1, rule.last_drift))  # a check happened at this step
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            val = sum(model(x, y).loss.item() for x, y in vals) / len(vals)
        results.append(
            {
                "choice": choice,
                "val_loss": val,
                "frozen_at": getattr(opt, "frozen_at", None),
                "bytes_sent": stats.snapshot().bytes_sent,
                "seconds": seconds,
                "drifts": drifts,
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog="python -m moebit.bench.freeze", description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--data", default=None, help="corpus path (default: the Python stdlib)")
    ap.add_argument("--data-mb", type=float, default=4.0, help="MB of the training split used")
    ap.add_argument("--seed", type=int, default=1337)
    rule = AutoFreeze()
    ap.add_argument("--auto-window", type=int, default=rule.window)
    ap.add_argument("--auto-threshold", type=float, default=rule.threshold)
    ap.add_argument("--auto-patience", type=int, default=rule.patience)
    ap.add_argument("--auto-min-steps", type=int, default=rule.min_steps)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)


    auto = {
        "window": args.auto_window, "threshold": args.auto_threshold,
        "patience": args.auto_patience, "min_steps": args.auto_min_steps,
    }
    AutoFreeze(**auto)  # check the thresholds here, not on the ranks

    fractions = [float(f) for f in args.fractions.split(",") if f]
    opts = {
        "steps": args.steps, "lr": args.lr, "warmup": args.warmup, "d_model": args.d_model,
        "n_layer": args.n_layer, "block_size": args.block_size, "batch_size": args.batch_size,
        "eval_batches": args.eval_batches, "data": args.data, "data_mb": args.data_mb,
        "seed": args.seed, "auto": auto, "choices": ["adam", *[str(f) for f in fractions], "auto"],
    }
    t0 = time.perf_counter()
    if args.world == 1:  # in this process: no compression happens, but the rule still runs
        results = _run_all(0, 1, opts)
    else:
        results = run_on_ranks(_run_all, world=args.world, args=(opts,), timeout=args.timeout)[0]
    adam = results[0]["val_loss"]
    print(f"{args.world} ranks, {args.steps} steps, lr {args.lr}, "
          f"{time.perf_counter() - t0:.0f} s in all")
    print(f"{'freeze':>10} {'frozen at':>10} {'val loss':>9} {'vs Adam':>8} {'MB sent':>8}")
    for r in results:
        label = r["choice"] if r["choice"] in ("adam", "auto") else f"{float(r['choice']):.0%}"
        at = "-" if r["frozen_at"] is None else str(r["frozen_at"])
        print(f"{label:>10} {at:>10} {r['val_loss']:9.4f} {r['val_loss'] / adam - 1:+8.2%} "
              f"{r['bytes_sent'] / 2**20:8.2f}")
    auto = results[-1]
    if auto["drifts"]:
        print("auto: drift of sqrt(v) per window: "
              + ", ".join(f"{s}:{d:.3f}" for s, d in auto["drifts"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"options": opts, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
