"""``moebit report RUN...``: loss curves of runs on shared axes, and a table."""

from __future__ import annotations

import argparse

from moebit.runs.report import report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moebit report", description="Compare run folders.")
    ap.add_argument("runs", nargs="+", help="run folders written by moebit train")
    ap.add_argument("--out", help="folder for the plots (default: the run, or the runs' parent)")
    args = ap.parse_args(argv)
    table, paths = report(args.runs, args.out)
    print(table)
    for p in paths:
        print(f"plot: {p}")
    return 0
