"""``python -m moebit.cli.ddp_peer``: launch a plain-DDP peer (PowerSGD, fp16 hook, Adam)
on moebit's model, data and schedule, for ``moebit bench train --peers``.

The ranks run ``python -m moebit.bench.ddp_peer --worker`` (``moebit.bench.ddp_peer``);
this module only parses the training flags, prepares the run folder and starts them.
"""

from __future__ import annotations

import argparse
import sys

from moebit.bench.ddp_peer import PEERS
from moebit.cli.launch import prepare_run_dir, run_ranks
from moebit.cli.train import parse_train_args

TORCHFT = "torchft_diloco"  # moebit.bench.torchft_peer: torchft's DiLoCo, not DDP


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m moebit.cli.ddp_peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=(*PEERS, TORCHFT), required=True)
    ap.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's matrix rank")
    ap.add_argument("--powersgd-start", type=int, default=None,
                    help="exact allreduce before this step (default: 20%% of the steps, as "
                         "1-bit Adam's default freeze)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="DDP bucket size (default: one bucket on gloo, DDP's default on NCCL)")
    args, rest = ap.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    cfg, launch = parse_train_args(rest)
    if (cfg.moe is not None and cfg.moe.ep_size > 1) or cfg.optimizer != "adam":
        raise SystemExit("ddp_peer: the DDP peers run Adam without expert parallelism "
                         f"(got --optimizer {cfg.optimizer}, --ep-size {cfg.moe.ep_size if cfg.moe else 1})")
    start = args.powersgd_start if args.powersgd_start is not None else max(2, round(0.2 * cfg.steps))
    run_dir = prepare_run_dir(cfg)
    worker_args = ["--worker", "--resolved-config", str(run_dir / "config.json"), "--peer",
                   args.peer, "--powersgd-rank", str(args.powersgd_rank), "--powersgd-start",
                   str(start)]
    if args.bucket_cap_mb is not None:
        worker_args += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    if args.peer == TORCHFT:
        run_ranks(launch, "moebit.bench.torchft_peer", worker_args[:3], "torchft DiLoCo peer")
        return 0
    run_ranks(launch, "moebit.bench.ddp_peer", worker_args, f"DDP peer {args.peer}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
