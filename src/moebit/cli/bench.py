"""``moebit bench NAME ...``: the benchmarks (see docs/benchmarks.md)."""

from __future__ import annotations

import importlib

from moebit.cli.args import UsageError

BENCHMARKS = ("comm", "moe", "train", "inference", "freeze", "a2a", "hf", "serve", "kernels",
              "decode")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: moebit bench {{{','.join(BENCHMARKS)}}} [options]")
        return 0 if argv else 2
    name = argv[0]
    if name not in BENCHMARKS:
        raise UsageError(f"unknown benchmark {name!r}: choose from {', '.join(BENCHMARKS)}")
    # Imported by name: each benchmark pulls its own peers (DeepSpeed, transformers, ...).
    mod = importlib.import_module(f"moebit.bench.{name}")
    return int(mod.main(argv[1:]) or 0)
