"""The table of docs/benchmarks/diloco.md from `moebit bench train --two-nodes` outputs.

    python docs/scripts/diloco_table.py OUT/a/results.json OUT/1bit/results.json ...
    python docs/scripts/diloco_table.py --target 3.2 OUT/a/results.json ...   # a looser target

The target validation loss is the one the first row (Adam) reaches at the end of its run;
time to target is the loop's wall clock at the first evaluation at or below it (rank 0's
metrics, launcher start-up excluded); inter-node bytes are the veth pair's counters (both
directions, frames: TCP/IP headers and start-up traffic included) over the tokens every
rank trained; peak outer MB is the largest single outer sync of rank 0 (moebit's counters).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moebit.bench.train import time_to_target
from moebit.runs import metrics


def _peak_outer(run: Path) -> float | None:
    recs = [r for r in metrics.read_run(run) if r["kind"] == "outer"]
    return max(r["outer_bytes_sent"] for r in recs) / 1e6 if recs else None


def rows(paths: list[str], target: float | None = None) -> tuple[float, list[dict]]:
    results = [(r, Path(p).parent.name) for p in paths
               for r in json.loads(Path(p).read_text())["results"]]
    target = results[0][0]["val_loss"] if target is None else target
    out = []
    for r, bench in results:
        if r.get("error"):
            out.append({"row": r["optimizer"], "error": r["error"]})
            continue
        run = Path(r["run"])
        cfg = json.loads((run / "config.json").read_text())
        out.append({"row": f"{r['optimizer']} ({bench})", "outer_every": cfg.get("outer_every"),
                    "time_to_target_s": time_to_target(metrics.read_run(run), target),
                    "inter_node_bytes_per_token": r.get("inter_node_bytes_per_token"),
                    "inter_node_bytes": r.get("inter_node_bytes"), "val_loss": r["val_loss"],
                    "tokens_per_s": r["tokens_per_s"], "peak_outer_mb": _peak_outer(run)})
    return target, out


def main(argv: list[str]) -> int:
    given = float(argv[1]) if argv[:1] == ["--target"] else None
    target, table = rows(argv[2:] if given is not None else argv, given)
    base = table[0]
    print(f"target validation loss ({'given' if given else 'the first row' + chr(39) + 's final'}): "
          f"{target:.4f}")
    print("| run | s to target | vs first | inter-node B/token | fewer inter-node bytes | "
          "val loss | vs first | tokens/s | peak outer MB/sync |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        if "error" in r:
            print(f"| {r['row']} | failed: {r['error']} |||||||")
            continue
        t, t0, peak = r["time_to_target_s"], base["time_to_target_s"], r["peak_outer_mb"]
        fewer = base["inter_node_bytes"] / r["inter_node_bytes"] if r["inter_node_bytes"] else None
        print(f"| {r['row']} | {'never' if t is None else f'{t:.1f}'} | "
              f"{f'{t0 / t:.2f}x' if t and t0 else '-'} | "
              f"{r['inter_node_bytes_per_token']:.4g} | {f'{fewer:.1f}x' if fewer else '-'} | "
              f"{r['val_loss']:.4f} | {r['val_loss'] / base['val_loss']:.4f} | "
              f"{r['tokens_per_s']:.0f} | "
              f"{'-' if peak is None else format(peak, '.4g')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
