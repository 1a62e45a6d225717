"""``moebit upcycle``: turn a dense run into an MoE run that continues from its loss.

    moebit upcycle runs/dense --num-experts 8 --run-dir runs/upcycled
    moebit upcycle runs/dense --num-experts 8 --moe-every 2 --noise 1e-3 \\
        --set num_experts_per_tok=2 --set bias_update_speed=1e-3 --run-dir runs/up
    moebit train --resume runs/upcycled --steps 600      # 600 counts the dense steps too

Every expert starts as a copy of its block's dense MLP, the router near zero; the new run
folder holds config.json and a complete checkpoint at the dense run's step with a fresh
optimizer state. With k >= 2 (norm_topk_prob) or softmax_before_topk=false and no
dropped tokens, the upcycled model computes what the dense one did (docs/moe-routing.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moebit.checkpoint import CheckpointError
from moebit.config import ConfigError
from moebit.upcycle import upcycle


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit upcycle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", metavar="RUN", help="dense run folder or RUN/checkpoints/step-N")
    ap.add_argument("--num-experts", required=True,
                    help="experts per MoE block: E, or one count per block (E1,E2,...)")
    ap.add_argument("--moe-every", type=int,
                    help="every N-th block becomes an MoE block (default: the run's, 2)")
    ap.add_argument("--noise", type=float, default=0.0, metavar="STD",
                    help="std of Gaussian noise added to each expert's weight matrices")
    ap.add_argument("--router-std", type=float, default=1e-3,
                    help="std of the new routers' weights (near 0: uniform top-k weights)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another training-config key of the MoE run, e.g. "
                         "num_experts_per_tok=2 (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the router and expert noise")
    ap.add_argument("--run-dir", required=True, help="the new run folder")
    return ap


def _settings(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.noise < 0 or args.router_std < 0:
        print("moebit upcycle: --noise and --router-std must be >= 0", file=sys.stderr)
        return 2
    experts: int | list[int] = ([int(v) for v in args.num_experts.split(",")]
                                if "," in args.num_experts else int(args.num_experts))
    try:
        ckpt = upcycle(args.run, args.run_dir, experts, moe_every=args.moe_every,
                       noise_std=args.noise, router_std=args.router_std,
                       settings=_settings(args.set), seed=args.seed)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"moebit upcycle: {e}", file=sys.stderr)
        return 2
    print(f"moebit upcycle: wrote {ckpt}; continue with: "
          f"moebit train --resume {args.run_dir} --steps N")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
