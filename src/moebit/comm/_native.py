"""Building moebit's small C kernels on first use: one compiler call, one cached library.

Shared by the bit-packing (``_bitpack_c``) and int8 row-quantization (``_rowquant_c``)
kernels. The library's file name carries a hash of its source, flags and machine, so a
changed kernel never loads a stale build; ranks that start at once serialise on a file
lock and the finished file appears atomically (``os.replace``), so none loads a torn one.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable

FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno"]
# a kernel's C signature: (argument types, result type)
Signature = tuple[list[type], type | None]


def native_enabled() -> bool:
    """False where the kernels are not built: turned off, or not Linux."""
    return os.environ.get("MOEBIT_NATIVE", "1") != "0" and platform.system() == "Linux"


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


def _build(path: str, source: str, libs: list[str]) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    src, tmp = f"{path}.{os.getpid()}.c", f"{path}.tmp{os.getpid()}"
    with open(src, "w") as f:
        f.write(source)
    try:
        res = subprocess.run([cc, *FLAGS, "-o", tmp, src, *libs], capture_output=True,
                             text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        for p in (src, tmp):
            if os.path.exists(p):
                os.remove(p)


def compile_library(name: str, source: str, libs: list[str] | None = None) -> ctypes.CDLL:
    """The library ``libmoebit_{name}_{hash}.so`` built from ``source`` (cached), loaded."""
    key = hashlib.sha256((source + " ".join(FLAGS) + platform.machine()).encode()).hexdigest()
    d = cache_dir()
    path = os.path.join(d, f"libmoebit_{name}_{key[:16]}.so")
    if not os.path.exists(path):
        with open(os.path.join(d, "build.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(path):
                _build(path, source, libs or [])
    return ctypes.CDLL(path)


def open_library(name: str, source: str, signatures: dict[str, Signature], what: str,
                 libs: list[str] | None = None,
                 init: Callable[[ctypes.CDLL], None] | None = None) -> ctypes.CDLL | None:
    """The library with its functions declared, or None (with one warning naming ``what``)
    where native kernels are off or the build fails: callers then take their torch path."""
    if not native_enabled():
        return None
    try:
        lib = compile_library(name, source, libs)
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
