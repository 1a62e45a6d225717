"""``moebit bench train``: optimizers side by side on real multi-rank training.

Runs ``moebit train`` once per optimizer with the same model, data, seed and steps (all
ranks inside a private namespace whose loopback is shaped to ``--link`` when given), and,
with ``--limit``, the same per-rank work with no communication at all: ``--nproc``
independent single-rank trainings at once, whose summed tokens/s bound what any
communication scheme can reach. Prints and writes (JSON) final validation loss, bytes on
the wire, throughput after the warm-up, and the step-time split into communication and
the rest, each against the first optimizer.

    moebit bench train --optimizers adam,onebit_adam --nproc 4 --steps 2000 --out bench-out/conv
    moebit bench train --link 1gbit --limit --nproc 4 --steps 60 --measure-from 30 -- --batch-size 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from moebit import metrics


def _train_argv(extra: list[str], optimizer: str, nproc: int, steps: int, run_dir: Path,
                freeze: str | None, seed: int) -> list[str]:
    argv = [sys.executable, "-m", "moebit.cli", "train", "--nproc", str(nproc), "--steps",
            str(steps), "--optimizer", optimizer, "--run-dir", str(run_dir), "--seed", str(seed),
            "--samples", "0"]
    if freeze is not None and optimizer not in ("adam", "lamb"):
        argv += ["--freeze-step", freeze]
    return argv + extra


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return metrics.read_run(run_dir)


def measure(run_dir: Path, measure_from: int) -> dict[str, Any]:
    """Throughput and step-time split over the logged windows after ``measure_from``."""
    recs = _records(run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    start = next(r for r in recs if r["kind"] == "start")
    end = next(r for r in reversed(recs) if r["kind"] == "end")
    train = [r for r in recs if r["kind"] == "train"]
    tokens_per_step = cfg["batch_size"] * cfg["block_size"] * start["world_size"]
    before = [r for r in train if r["step"] <= measure_from]
    after = [r for r in train if r["step"] > measure_from]
    if not before or not after:
        raise ValueError(f"{run_dir}: no logged window after step {measure_from}; lower "
                         "--measure-from or --log-every")
    a, b = before[-1], after[-1]
    steps = b["step"] - a["step"]
    seconds = b["train_time"] - a["train_time"]
    comm = sum(r["comm_seconds_per_step"] * cfg["log_every"] for r in after) / max(1, steps)
    return {
        "run": str(run_dir), "optimizer": cfg["optimizer"], "world_size": start["world_size"],
        "n_params": start["n_params"], "val_loss": end["val_loss"],
        "bytes_sent": end["bytes_sent"], "frozen_at": end.get("frozen_at"),
        "tokens_per_s": tokens_per_step * steps / seconds,
        "step_s": seconds / steps, "comm_s_per_step": comm,
        "comm_share": comm / (seconds / steps),
    }


def _run(argv: list[str], link: str | None, timeout: float) -> None:
    if link:
        from moebit.bench.netns import run_in_shaped_netns

        proc = run_in_shaped_netns(argv, link, timeout=timeout)
    else:
        proc = subprocess.run(argv, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}): {' '.join(argv)}")


def limit_run(extra: list[str], nproc: int, steps: int, out: Path, seed: int,
              timeout: float) -> list[Path]:
    """``nproc`` single-rank trainings at once: the same per-rank work, no communication."""
    dirs = [out / f"nocomm-{i}" for i in range(nproc)]
    if "--threads" not in extra:  # as many threads per process as each rank of the real run
        extra = extra + ["--threads", str(max(1, (os.cpu_count() or 1) // nproc))]
    procs = [subprocess.Popen(_train_argv(extra, "adam", 1, steps, d, None, seed + i),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i, d in enumerate(dirs)]
    for p in procs:
        if p.wait(timeout=timeout) != 0:
            raise RuntimeError("a no-communication run failed")
    return dirs


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="moebit bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default="adam,onebit_adam")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--freeze-step", default=None, help="for the 1-bit optimizers (N or auto)")
    ap.add_argument("--measure-from", type=int, default=None,
                    help="throughput counted after this step (default: 60%% of the run)")
    ap.add_argument("--link", default=None, help="shape loopback to this rate, e.g. 1gbit")
    ap.add_argument("--limit", action="store_true", help="also run the no-communication limit")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", default="bench-out/train")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--json", default=None, help="write the results here (default OUT/results.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measure_from = args.measure_from if args.measure_from is not None else int(0.6 * args.steps)
    results = []
    for opt in args.optimizers.split(","):
        exact = opt in ("adam", "lamb")
        run_dir = out / (opt if exact or args.freeze_step is None else f"{opt}-freeze{args.freeze_step}")
        print(f"== {opt}: {args.nproc} ranks, {args.steps} steps"
              + (f", link {args.link}" if args.link else ""), file=sys.stderr, flush=True)
        _run(_train_argv(extra, opt, args.nproc, args.steps, run_dir, args.freeze_step,
                         args.seed), args.link, args.timeout)
        results.append(measure(run_dir, measure_from))
    if args.limit:
        print(f"== no-communication limit: {args.nproc} independent single-rank runs",
              file=sys.stderr, flush=True)
        dirs = limit_run(extra, args.nproc, args.steps, out, args.seed, args.timeout)
        parts = [measure(d, measure_from) for d in dirs]
        results.append({"run": str(out / "nocomm-*"), "optimizer": "no communication (limit)",
                        "world_size": args.nproc, "n_params": parts[0]["n_params"],
                        "val_loss": None, "bytes_sent": 0, "frozen_at": None,
                        "tokens_per_s": sum(p["tokens_per_s"] for p in parts),
                        "step_s": max(p["step_s"] for p in parts), "comm_s_per_step": 0.0,
                        "comm_share": 0.0})
    base = results[0]
    for r in results:
        r["val_loss_vs_first"] = (r["val_loss"] / base["val_loss"]) if r["val_loss"] else None
        r["bytes_fewer_than_first"] = (base["bytes_sent"] / r["bytes_sent"]) if r["bytes_sent"] else None
        r["tokens_per_s_vs_first"] = r["tokens_per_s"] / base["tokens_per_s"]
    print(format_table(results, args.link))
    (Path(args.json) if args.json else out / "results.json").write_text(
        json.dumps({"link": args.link, "nproc": args.nproc, "steps": args.steps,
                    "measure_from": measure_from, "extra": extra, "results": results}, indent=2))
    return 0


def format_table(results: list[dict[str, Any]], link: str | None) -> str:
    head = ["optimizer", "val loss", "vs first", "MB sent/rank", "fewer bytes", "tokens/s",
            "speed vs first", "step s", "comm share"]
    rows = []
    for r in results:
        rows.append([
            str(r["optimizer"]) + (f" (froze {r['frozen_at']})" if r.get("frozen_at") else ""),
            f"{r['val_loss']:.4f}" if r["val_loss"] else "-",
            f"{r['val_loss_vs_first']:.4f}" if r["val_loss_vs_first"] else "-",
            f"{r['bytes_sent'] / 1e6:.1f}",
            f"{r['bytes_fewer_than_first']:.2f}x" if r["bytes_fewer_than_first"] else "-",
            f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s_vs_first']:.2f}x",
            f"{r['step_s']:.3f}", f"{100 * r['comm_share']:.0f}%",
        ])
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    line = "  ".join(f"{{:<{n}}}" for n in w)
    title = f"link: {link or 'loopback (unshaped)'}"
    return "\n".join([title, line.format(*head), line.format(*("-" * n for n in w))]
                     + [line.format(*x) for x in rows])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
