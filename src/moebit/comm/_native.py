"""Building moebit's small C kernels on first use: one compiler call, one cached library.

Shared by the bit-packing (``_bitpack_c``), int8 row-quantization (``_rowquant_c``) and
weight-only GEMV (``moebit.inference._qgemv_c``) kernels. The library's file name carries
a hash of its source, flags and machine, so a changed kernel never loads a stale build;
ranks that start at once serialise on a file lock and the finished file appears
atomically (``os.replace``), so none loads a torn one.

Runtime ISA dispatch: each source is written with ``#ifdef __AVX2__`` / ``__AVX512F__``
sections over a portable C (SSE2 on x86-64) baseline, and is compiled once per ISA level
with that level's flags (``ISA_FLAGS``) into its own library. ``select_isa()`` picks the
best level the CPU reports (``/proc/cpuinfo`` flags) at load time, so one installation
runs the widest vectors on each host and never an instruction a host lacks.
``MOEBIT_ISA=portable`` (or ``avx2``) forces a lower level: tests use it to check every
variant against the same reference. Only the chosen variant is built.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable

FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno"]
# ISA level -> (extra compiler flags, /proc/cpuinfo flags the CPU must report), lowest first
ISA_FLAGS: dict[str, tuple[list[str], set[str]]] = {
    "portable": ([], set()),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    "avx512": (["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                "-mavx512dq", "-mavx512vnni"],
               {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                "avx512_vnni"}),
}
# a kernel's C signature: (argument types, result type)
Signature = tuple[list[type], type | None]


def native_enabled() -> bool:
    """False where the kernels are not built: turned off, or not Linux."""
    return os.environ.get("MOEBIT_NATIVE", "1") != "0" and platform.system() == "Linux"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_isas() -> list[str]:
    """The ISA levels this CPU can run, lowest first (always at least "portable")."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["portable"]
    have = cpu_flags()
    return [isa for isa, (_, need) in ISA_FLAGS.items() if need <= have]


def select_isa() -> str:
    """The ISA level kernels load at: ``MOEBIT_ISA`` if set and runnable, else the best."""
    runnable = supported_isas()
    want = os.environ.get("MOEBIT_ISA", "auto").strip().lower() or "auto"
    if want == "auto":
        return runnable[-1]
    if want not in ISA_FLAGS:
        raise ValueError(f"MOEBIT_ISA must be auto or one of {list(ISA_FLAGS)}, got {want!r}")
    if want not in runnable:
        warnings.warn(f"moebit: MOEBIT_ISA={want} but this CPU runs only {runnable}; "
                      f"using {runnable[-1]}", RuntimeWarning, stacklevel=2)
        return runnable[-1]
    return want


def cache_dir() -> str:
    """``MOEBIT_NATIVE_CACHE``, else ~/.cache/moebit/native, else a per-user temp folder."""
    base = os.environ.get("MOEBIT_NATIVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "moebit", "native"
    )
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    base = os.path.join(tempfile.gettempdir(), f"moebit-native-{os.getuid()}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    return base


def _build(path: str, source: str, flags: list[str], libs: list[str]) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    src, tmp = f"{path}.{os.getpid()}.c", f"{path}.tmp{os.getpid()}"
    with open(src, "w") as f:
        f.write(source)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, src, *libs], capture_output=True,
                             text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        for p in (src, tmp):
            if os.path.exists(p):
                os.remove(p)


def compile_library(name: str, source: str, libs: list[str] | None = None,
                    isa: str = "portable", extra_flags: list[str] | None = None) -> ctypes.CDLL:
    """The library ``libmoebit_{name}_{isa}_{hash}.so`` built from ``source`` with ``isa``'s
    flags (cached), loaded; its ``moebit_isa`` attribute names the level."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown ISA level {isa!r}; known: {list(ISA_FLAGS)}")
    flags = [*FLAGS, *ISA_FLAGS[isa][0], *(extra_flags or [])]
    key = hashlib.sha256((source + " ".join(flags + (libs or [])) + platform.machine())
                         .encode()).hexdigest()
    d = cache_dir()
    path = os.path.join(d, f"libmoebit_{name}_{isa}_{key[:16]}.so")
    if not os.path.exists(path):
        with open(os.path.join(d, "build.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(path):
                _build(path, source, flags, libs or [])
    lib = ctypes.CDLL(path)
    lib.moebit_isa = isa
    return lib


def open_library(name: str, source: str, signatures: dict[str, Signature], what: str,
                 libs: list[str] | None = None,
                 init: Callable[[ctypes.CDLL], None] | None = None,
                 isa: str | None = None,
                 extra_flags: list[str] | None = None) -> ctypes.CDLL | None:
    """The library with its functions declared, or None (with one warning naming ``what``)
    where native kernels are off or the build fails: callers then take their torch path.
    ``isa``: the level to build for (default ``select_isa()``); tests pass each level."""
    if not native_enabled():
        return None
    try:
        lib = compile_library(name, source, libs, isa or select_isa(), extra_flags)
        for fn_name, (args, res) in signatures.items():
            fn = getattr(lib, fn_name)
            fn.argtypes, fn.restype = args, res
        if init is not None:
            init(lib)
    except Exception as e:  # noqa: BLE001 - any failure means: use the portable path
        warnings.warn(f"moebit: native {what} unavailable ({e}); using the torch path",
                      RuntimeWarning, stacklevel=3)
        return None
    return lib
