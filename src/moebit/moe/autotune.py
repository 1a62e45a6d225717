"""Kernels chosen by measurement on this machine, remembered on disk.

    tuned = choose("experts|swiglu|...|rows64", {"loop": run_loop, "padded": run_padded},
                   default="loop")
    tuned.choice, tuned.times   # the fastest name; every candidate's median seconds

Why: which expert kernel or GEMV wins depends on the CPU (vector width, cache sizes, core
count), the thread count, the shapes and the row counts, and thresholds measured on one
host are wrong on the next. So the first call for a problem key times every candidate on
the real inputs (interleaved rounds, so that foreign load hits all alike; the median of
``REPS``) and keeps the fastest; later calls look the choice up in memory.

The file (``MOEBIT_AUTOTUNE_CACHE``, default ``~/.cache/moebit/autotune.json``) is keyed
by ``machine_key()`` = CPU model, the ISA level the native kernels run at, the CPU flags
that change code paths, and the torch version, so a copied home folder or an upgraded
torch never reuses another machine's choice. A file that does not parse is set aside
(one warning) and rebuilt; writers take a lock, merge and replace the file atomically,
so ranks tuning at once keep each other's entries.

``MOEBIT_AUTOTUNE=0`` turns measuring off: every choice is then the caller's
deterministic ``default`` (tests use it so that a kernel choice never depends on load).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moebit.comm import _native

REPS = 5  # timed rounds per candidate (after one warm-up round)
# CPU flags that select different code in torch or in moebit's kernels
_KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni", "asimd", "sve")


@dataclass
class Tuned:
    """A choice and, where it was measured in this process, each candidate's median time."""

    choice: str
    times: dict[str, float] = field(default_factory=dict)
    measured: bool = False  # True only for the call that ran the measurement


def enabled() -> bool:
    """False where ``MOEBIT_AUTOTUNE=0``: choices are then the callers' defaults."""
    return os.environ.get("MOEBIT_AUTOTUNE", "1") != "0"


def cache_path() -> str:
    """``MOEBIT_AUTOTUNE_CACHE``, else ~/.cache/moebit/autotune.json."""
    return _cache_path(os.environ.get("MOEBIT_AUTOTUNE_CACHE", ""))


@functools.cache
def _cache_path(env: str) -> str:  # looked up on every kernel call: computed once
    return env or os.path.join(os.path.expanduser("~"), ".cache", "moebit", "autotune.json")


def machine_key() -> str:
    """CPU model | native ISA level | code-path flags | torch version."""
    return _machine_key(os.environ.get("MOEBIT_ISA", ""), os.environ.get("MOEBIT_NATIVE", ""))


@functools.cache
def _machine_key(isa_env: str, native_env: str) -> str:  # once per setting: reads /proc
    try:
        isa = _native.select_isa() if _native.native_enabled() else "off"
    except ValueError:
        isa = "invalid"
    flags = sorted(f for f in _KEY_FLAGS if f in _native.cpu_flags())
    return f"{_native.cpu_model()}|isa={isa}|{','.join(flags)}|torch={torch.__version__}"


def rows_bucket(n: int) -> int:
    """The power of two at or above ``n`` (0 stays 0): row counts tuned together."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def _read(path: str) -> dict:
    """The cache file's contents; {} where it is missing; a corrupt file is moved aside."""
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError("not a {machine: {problem: entry}} object")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"moebit: autotune cache {path} is unreadable ({e}); rebuilding it",
                      RuntimeWarning, stacklevel=4)
        try:
            os.replace(path, f"{path}.corrupt")
        except OSError:
            pass
        return {}


def _write(path: str, machine: str, problem: str, entry: dict) -> None:
    """Merge one entry into the file under a lock; the new file appears atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read(path)
        data.setdefault(machine, {})[problem] = entry
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


_memory: dict[tuple[str, str, str], Tuned] = {}  # (file, machine, problem) -> choice


def reset() -> None:
    """Forget the choices held in memory (the file stays): tests and benchmarks re-tune."""
    _memory.clear()


def cached(problem: str) -> Tuned | None:
    """The choice for ``problem`` on this machine, from memory or the file; None if unknown."""
    if not enabled():
        return None
    path, machine = cache_path(), machine_key()
    hit = _memory.get((path, machine, problem))
    if hit is None:
        entry = _read(path).get(machine, {}).get(problem)
        if isinstance(entry, dict) and isinstance(entry.get("choice"), str):
            hit = Tuned(entry["choice"], dict(entry.get("times_s", {})))
            _memory[(path, machine, problem)] = hit
    return hit


def measure(candidates: dict[str, Callable[[], object]], reps: int = REPS) -> dict[str, float]:
    """Each candidate's median wall time over ``reps`` interleaved rounds, after a warm-up."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def choose(problem: str, candidates: dict[str, Callable[[], object]], default: str,
           reps: int = REPS) -> Tuned:
    """The fastest candidate for ``problem`` (measured once per machine, then remembered);
    ``default`` where tuning is off or only one candidate exists. A remembered choice that
    is no longer a candidate is measured again."""
    if default not in candidates:
        raise ValueError(f"autotune: default {default!r} is not among {list(candidates)}")
    if not enabled() or len(candidates) == 1:
        return Tuned(default)
    hit = cached(problem)
    if hit is not None and hit.choice in candidates:
        return hit
    times = measure(candidates, reps)
    best = min(times, key=times.__getitem__)
    remember(problem, best, times)
    return Tuned(best, times, measured=True)


def remember(problem: str, choice: str, times: dict[str, float]) -> None:
    """Keep ``choice`` for ``problem`` in memory and in the file (callers that measure
    their own way: collectives timed on every rank together)."""
    path, machine = cache_path(), machine_key()
    _memory[(path, machine, problem)] = Tuned(choice, times)
    try:
        _write(path, machine, problem, {"choice": choice, "times_s": times})
    except OSError as e:  # a read-only home still tunes, per process
        warnings.warn(f"moebit: cannot write autotune cache {path} ({e})", RuntimeWarning,
                      stacklevel=3)
