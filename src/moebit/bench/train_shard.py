"""Sharded rows of ``moebit bench train``: ``--shards`` and ``--rank-memory-cap``.

``--shards none,fsdp,fsdp:rs=int8`` runs each optimizer once per sharding setting
(``MODE[:rs=FMT][:ag=FMT][:unit=U][:keep]``: ``--shard MODE --rs-compress FMT
--ag-compress FMT --shard-unit U --no-reshard-after-forward``), and
adds a table of what sharding is for: this rank's model-state bytes
(``state_bytes_per_rank``: parameters, gradients, optimizer state) and peak RSS, the
gradient reduce-scatter and weight all-gather bytes, throughput, and the last logged
training loss, each against the first row.

``--rank-memory-cap 2GiB`` sets RLIMIT_AS (address space) on the training command; every
process it starts (torchrun's agent, each rank) inherits the cap. A row that does not
fit fails: it is recorded with its error line instead of stopping the benchmark.

The capped command runs with glibc's allocator told to map only what is live
(``CAPPED_MALLOC``, unless the environment already sets those keys): by default each
thread's arena reserves 64 MiB of address space, and freed buffers up to 32 MiB (FSDP's
per-block all-gather and reduce-scatter buffers) stay in the heap once the dynamic mmap
threshold has risen past them, so a sharded rank's address space (and resident set)
climbed to the replicated rank's whatever it held live.
"""

from __future__ import annotations

import os
import resource
import subprocess
from collections.abc import Callable
from typing import Any

from moebit.training.shard_config import MODES, SHARD_MODES, UNITS
from moebit.training.shard_memory import size_bytes


def parse_shards(text: str) -> list[tuple[str, list[str]]]:
    """(label, ``moebit train`` flags) of each ``--shards`` entry; a bad one is named."""
    rows = []
    for spec in text.split(","):
        mode, *opts = spec.strip().split(":")
        if mode not in SHARD_MODES:
            raise ValueError(f"--shards: {spec!r}: the mode must be one of {', '.join(SHARD_MODES)}")
        flags = [] if mode == "none" else ["--shard", mode]
        for opt in opts:
            key, _, fmt = opt.partition("=")
            if mode == "none":
                raise ValueError(f"--shards: {spec!r}: {opt!r} is a setting of a sharded row")
            if key == "keep" and not fmt:
                flags.append("--no-reshard-after-forward")
            elif key == "unit" and fmt in UNITS:
                flags += ["--shard-unit", fmt]
            elif key in ("rs", "ag") and fmt in MODES:
                flags += [f"--{key}-compress", fmt]
            else:
                raise ValueError(f"--shards: {spec!r}: {opt!r} is not rs=FMT or ag=FMT (FMT one "
                                 f"of {', '.join(MODES)}), unit=U (U one of {', '.join(UNITS)}) "
                                 f"or keep")
        rows.append((spec.strip(), flags))
    return rows


def cap_bytes(text: str | None) -> int | None:
    return None if text is None else size_bytes(text, "--rank-memory-cap")


def _limit_as(cap: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return apply


# glibc: two arenas, and every allocation from 128 KiB up its own mapping, unmapped when freed
CAPPED_MALLOC = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}


def capped_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``CAPPED_MALLOC`` for keys it does not set."""
    base = dict(os.environ if env is None else env)
    return {**CAPPED_MALLOC, **base}


def run_capped(argv: list[str], cap: int, timeout: float) -> str | None:
    """Run ``argv`` under an address-space cap; None when it succeeded, else its last
    error line (the rank's MemoryError / the launcher's one-line summary)."""
    proc = subprocess.run(argv, timeout=timeout, preexec_fn=_limit_as(cap),
                          capture_output=True, text=True, env=capped_env())
    if proc.returncode == 0:
        return None
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    mem = [ln for ln in lines if "MemoryError" in ln or "alloc" in ln.lower()]
    return f"exit {proc.returncode}: {(mem or lines or ['(no output)'])[-1][:300]}"


def shard_fields(recs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """A run's memory, sharded-collective bytes and last logged loss, from its records."""
    end = next(r for r in reversed(recs) if r["kind"] == "end")
    train = [r for r in recs if r["kind"] == "train"]
    kinds = end.get("bytes_sent_by_kind") or {}
    return {"shard": cfg.get("shard", "none"), "rs_compress": cfg.get("rs_compress", "none"),
            "ag_compress": cfg.get("ag_compress", "none"),
            "state_bytes_per_rank": end.get("state_bytes_per_rank"),
            "peak_rss_mb": end.get("peak_rss_mb"),
            "grad_bytes": kinds.get("rs", 0) + kinds.get("exact", 0),
            "rs_bytes": kinds.get("rs", 0), "ag_bytes": kinds.get("ag", 0),
            "last_loss": train[-1]["loss"] if train else None,
            "last_step": train[-1]["step"] if train else None}


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.3f}x"


def format_shard_table(results: list[dict[str, Any]], failed: list[dict[str, Any]]) -> str:
    """Memory, collective bytes, speed and loss of each row against the first."""
    head = ["run", "state MB/rank", "vs first", "peak RSS MB", "grad MB", "fewer grad bytes",
            "ag MB", "tokens/s vs first", "loss@step", "|d loss| vs first"]
    base = results[0] if results else {}
    rows = []
    for r in results:
        dloss = (None if r.get("last_loss") is None or base.get("last_loss") is None
                 else abs(r["last_loss"] - base["last_loss"]))
        rows.append([
            str(r["optimizer"]), f"{(r.get('state_bytes_per_rank') or 0) / 1e6:.2f}",
            _ratio(r.get("state_bytes_per_rank"), base.get("state_bytes_per_rank")),
            f"{r.get('peak_rss_mb') or 0:.0f}", f"{r.get('grad_bytes', 0) / 1e6:.2f}",
            _ratio(base.get("grad_bytes"), r.get("grad_bytes")),
            f"{r.get('ag_bytes', 0) / 1e6:.2f}", f"{r['tokens_per_s_vs_first']:.2f}x",
            f"{r.get('last_loss', float('nan')):.6f}@{r.get('last_step')}",
            "-" if dloss is None else f"{dloss:.2e}"])
    w = [max(len(h), *(len(x[i]) for x in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = "  ".join(f"{{:<{n}}}" for n in w)
    return "\n".join([line.format(*head), line.format(*("-" * n for n in w))]
                      + [line.format(*x).rstrip() for x in rows]
                      + [f"{f['optimizer']}: FAILED: {f['error']}" for f in failed])
