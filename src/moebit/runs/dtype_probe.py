"""``--dtype auto``: train in bf16 autocast only where this machine runs it faster than fp32.

Why measure instead of reading CPU flags: bf16 autocast on a CPU without native bf16
instructions (AVX2-only x86, e.g. AMD Zen 2/3 or Intel before Cooper Lake) emulates every
bf16 matmul and is several times *slower* than fp32, while on a CPU with avx512_bf16 or
AMX it is 2-3x faster; which kernels torch picks also changes between torch builds. So
the launcher times one small linear layer, forward and backward, in both modes (a few
tenths of a second) and keeps the answer in a small JSON cache whose key names the CPU
model, its ISA flags and the torch version. A cache that cannot be read is measured again
and rewritten; a probe that fails picks fp32, which is always correct.

The launcher resolves ``auto`` once, before any rank starts, writes the chosen dtype into
the run's ``config.json`` (so every rank, a resume and ``moebit eval`` agree) and passes
the reason to the ranks in ``MOEBIT_DTYPE_CHOICE`` for the run's ``start`` record.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from moebit.checkpoint.files import write_text_atomic

ENV_CACHE = "MOEBIT_DTYPE_CACHE"  # the cache file (tests point it at a temporary folder)
ENV_CHOICE = "MOEBIT_DTYPE_CHOICE"  # launcher -> ranks: the choice and its reason (JSON)
DTYPES = ("auto", "bf16", "fp32")
# bf16 must be at least this much faster to be chosen: near parity fp32 keeps full precision.
MIN_SPEEDUP = 1.25
# The ISA flags that decide how fast bf16 and fp32 matmuls run.
ISA_WORDS = ("avx", "amx", "bf16", "fma", "f16c", "asimd", "sve", "neon", "vnni")
SHAPE = (256, 256, 512)  # rows, in features, out features of the probe's linear layer


@dataclass
class Choice:
    """What ``--dtype`` resolved to, and why (one line, printed and recorded)."""

    dtype: str
    reason: str
    requested: str = "auto"
    bf16_over_fp32: float | None = None  # measured time ratio (above 1: bf16 is slower)
    cache: str | None = None

    def line(self) -> str:
        return f"dtype {self.requested} -> {self.dtype} ({self.reason})"


def cache_file() -> Path:
    """``MOEBIT_DTYPE_CACHE``, else ``$XDG_CACHE_HOME/moebit/dtype-probe.json``."""
    given = os.environ.get(ENV_CACHE)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moebit" / "dtype-probe.json"


def cpu_identity() -> tuple[str, list[str]]:
    """(CPU model name, its matmul-relevant ISA flags), from /proc/cpuinfo where there is one."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = sorted(f for f in value.split() if any(w in f for w in ISA_WORDS))
    return model, flags


def probe_key() -> str:
    model, flags = cpu_identity()
    text = json.dumps([model, flags, platform.machine(), torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _time_step(x: torch.Tensor, w: torch.Tensor, bf16: bool) -> float:
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = torch.nn.functional.linear(x, w)
    y.float().square().mean().backward()
    return time.perf_counter() - t0


def measure_ratio(reps: int = 3) -> float:
    """Time of one bf16-autocast linear forward+backward over its fp32 time (best of
    ``reps`` each, interleaved so that a busy machine slows both alike), on one thread as a
    rank of a multi-rank run has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        rows, d_in, d_out = SHAPE
        x = torch.randn(rows, d_in, generator=gen, requires_grad=True)
        w = torch.randn(d_out, d_in, generator=gen, requires_grad=True)
        _time_step(x, w, False), _time_step(x, w, True)  # warm-up: first calls pick kernels
        fp32, bf16 = float("inf"), float("inf")
        for _ in range(reps):
            fp32 = min(fp32, _time_step(x, w, False))
            bf16 = min(bf16, _time_step(x, w, True))
        return bf16 / fp32
    finally:
        torch.set_num_threads(threads)


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries; an unreadable or malformed file counts as empty (rebuilt)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cpu_ratio() -> tuple[float, Path, bool]:
    """(bf16/fp32 time ratio on this CPU, the cache file, whether it came from the cache)."""
    path, key = cache_file(), probe_key()
    entries = _read_cache(path)
    entry = entries.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("bf16_over_fp32"), (int, float)) \
            and entry["bf16_over_fp32"] > 0:
        return float(entry["bf16_over_fp32"]), path, True
    ratio = measure_ratio()
    model, flags = cpu_identity()
    entries[key] = {"bf16_over_fp32": ratio, "cpu": model, "flags": flags,
                    "torch": torch.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        write_text_atomic(json.dumps(entries, indent=2) + "\n", path)
    except OSError:
        pass  # a read-only home: the choice still holds for this run, it is just not kept
    return ratio, path, False


def _isa_summary(flags: list[str]) -> str:
    shown = [f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")]
    return ", ".join(shown) or "no avx2"


def _cpu_choice() -> Choice:
    model, flags = cpu_identity()
    try:
        ratio, path, cached = cpu_ratio()
    except Exception as e:  # noqa: BLE001 - any probe failure falls back to the always-correct fp32
        return Choice("fp32", f"the bf16 probe failed ({type(e).__name__}: {e}); fp32 is the fallback")
    where = f"{'cached' if cached else 'measured now, cached'} in {path}"
    on = f"on {model}, {_isa_summary(flags)}"
    if ratio * MIN_SPEEDUP <= 1.0:
        return Choice("bf16", f"bf16 autocast measured {1 / ratio:.1f}x faster than fp32 {on}; {where}",
                      bf16_over_fp32=ratio, cache=str(path))
    how = (f"{ratio:.1f}x slower than" if ratio >= 1.0
           else f"only {1 / ratio:.2f}x faster than (needs {MIN_SPEEDUP}x)")
    return Choice("fp32", f"bf16 autocast measured {how} fp32 {on}; {where}",
                  bf16_over_fp32=ratio, cache=str(path))


def resolve(requested: str, device: str = "auto", nnodes: int = 1) -> Choice:
    """The dtype a run trains in for ``--dtype requested`` on ``--device device``."""
    if requested not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)} (got {requested!r})")
    if requested != "auto":
        return Choice(requested, "given", requested)
    if nnodes > 1:
        return Choice("fp32", "several nodes: each would probe its own CPU and they must agree; "
                      "give --dtype bf16 on a cluster whose CPUs run it fast")
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if on_cuda:
        if torch.cuda.is_bf16_supported():
            return Choice("bf16", f"{torch.cuda.get_device_name()} supports bf16")
        return Choice("fp32", f"{torch.cuda.get_device_name()} has no bf16 support")
    return _cpu_choice()


def to_env(choice: Choice) -> str:
    return json.dumps(asdict(choice))


def start_fields(dtype: str) -> dict[str, Any]:
    """Fields of a run's ``start`` record: the dtype trained in and, where the launcher
    resolved ``auto``, the reason."""
    out: dict[str, Any] = {"dtype": dtype}
    try:
        choice = json.loads(os.environ.get(ENV_CHOICE, ""))
    except ValueError:
        return out
    if isinstance(choice, dict) and choice.get("dtype") == dtype:
        out["dtype_requested"] = choice.get("requested")
        out["dtype_reason"] = choice.get("reason")
    return out
