"""``moebit plan memory``: the per-rank memory of a training configuration, replicated
and sharded, and a refusal when it does not fit the memory a rank has.

    moebit plan memory --nproc 4 --memory-per-rank 2GiB -- --n-layer 12 --d-model 768 --shard fsdp
    moebit plan memory --nproc 8 --nnodes 2 -- --init-from hf/mixtral --ep-size 2

The flags after ``--`` are ``moebit train``'s (its config keys); the configuration's own
``--shard`` (none by default) is the plan that must fit ``--memory-per-rank``: exit 2 with
one line naming what does not fit, and whether another shard setting would.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moebit.plan.benchmode import parse_train_flags
from moebit.plan.memory import format_memory, gib, parse_size, plan_memory
from moebit.plan.spec import SpecError


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit plan memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks per node")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--memory-per-rank", metavar="SIZE",
                    help="what one rank may use (24GiB, 1.5GB, 512MiB): refuse a plan above it")
    ap.add_argument("--json", help="write the prediction here")
    return ap


def run_memory(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = parser().parse_args(argv)
    for name in ("nproc", "nnodes"):
        if getattr(args, name) < 1:
            raise SpecError(f"--{name} must be >= 1 (got {getattr(args, name)})")
    limit = parse_size(args.memory_per_rank) if args.memory_per_rank else None
    cfg = parse_train_flags(extra)
    world = args.nproc * args.nnodes
    rows = plan_memory(cfg, world, args.nproc)
    print(format_memory(rows, world, limit))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"world": world, "node": args.nproc,
                                               "memory_per_rank": limit, "extra": extra,
                                               "rows": [r.to_dict() for r in rows]}, indent=2))
    chosen = next(r for r in rows if r.shard == cfg.shard)
    if limit is not None and chosen.total > limit:
        fits = [r.shard for r in rows if r.total <= limit]
        hint = f"; shard={fits[0]} fits ({gib(next(r.total for r in rows if r.shard == fits[0]))})" \
            if fits else "; no shard setting fits: more ranks, a smaller batch or model"
        raise SpecError(f"memory: shard={cfg.shard} needs {gib(chosen.total)} per rank "
                        f"(state {gib(chosen.state)}, activations {gib(chosen.activations)}), "
                        f"more than --memory-per-rank {gib(limit)}{hint}")
    return 0


def main(argv: list[str]) -> int:
    return run_memory(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
