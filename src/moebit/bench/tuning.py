"""What ``kernel="auto"`` chose in a benchmarked layer, and how to print it.

Benchmarks (``moebit bench moe``) run their layers with an empty tuning cache, so the
autotuner (``moebit.moe.autotune``) measures every candidate kernel in the run itself;
these helpers collect each choice with every candidate's time from the layer's
``Experts.tuned`` and format one line per problem.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from moebit.moe.experts import Experts


@contextmanager
def fresh_tuning(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """``env`` with tuning on and an empty cache file (removed afterwards): a worker started
    with it measures auto's candidates in this run, on this machine's present load."""
    with tempfile.TemporaryDirectory(prefix="moebit-bench-tune-") as tune:
        yield dict(env, MOEBIT_AUTOTUNE="1",
                   MOEBIT_AUTOTUNE_CACHE=os.path.join(tune, "autotune.json"))


def auto_choices(module: nn.Module) -> dict[str, dict[str, Any]]:
    """What kernel="auto" chose in ``module``'s expert layers: {problem key: {"choice",
    "times_ms"}} (times of every candidate, as measured by the autotuner)."""
    out: dict[str, dict[str, Any]] = {}
    for m in module.modules():
        if isinstance(m, Experts):
            for key, t in m.tuned.items():
                out[key] = {"choice": t.choice,
                            "times_ms": {k: round(1e3 * v, 3) for k, v in t.times.items()}}
    return out


def auto_lines(auto: dict[str, dict[str, Any]]) -> list[str]:
    """One line per auto choice: the problem, the pick, every candidate's time."""
    out = []
    for key, t in sorted(auto.items()):
        parts = dict(p.split("=", 1) for p in key.split("|") if "=" in p)
        mode = "fwd+bwd" if "|train|" in key else "fwd"
        times = ", ".join(f"{k} {v:.1f}" for k, v in sorted(t["times_ms"].items(),
                                                           key=lambda kv: kv[1]))
        out.append(f"auto ({mode}, {parts.get('rows', '?')} rows, {parts.get('busy', '?')} "
                   f"busy experts): {t['choice']}" + (f"  [ms: {times}]" if times else ""))
    return out
