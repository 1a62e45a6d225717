"""``moebit bench kernels``: the native kernels at every ISA level this CPU runs.

    python -m moebit.bench.kernels                          # sign packing and GEMV, 1 thread
    python -m moebit.bench.kernels --rows 1,4,16 --n 4096 --k 4096 --threads 2 --json k.json

Two measurements, each candidate timed in interleaved rounds (round 1 of every candidate,
then round 2...) so that foreign load on a shared machine hits all alike; medians over
``--reps`` of wall time and of this thread's CPU time (``time.thread_time``: less
sensitive to other jobs taking the core, and meaningful only at one thread):

- sign packing (``moebit.comm.bitpack``'s ``mb_pack`` and the fused error-feedback step
  ``mb_worker``), one thread, on a cache-resident (2^16) and a memory-sized (2^24)
  float32 vector: elements per second.
- weight-only GEMV-GEMM (``moebit.inference.qgemv``) at each row count: native int8 (per
  channel) and int4 (groups of 32) at each ISA level, against torch's float32 ``mm`` and
  ``torch._weight_int8pack_mm`` (bf16 activations, int8 per channel): GB/s of weight
  bytes read (packed bytes plus scales; fp32 reads 4 bytes a weight).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from moebit.comm import _bitpack_c, _native
from moebit.inference import _qgemv_c, qgemv


def _interleaved(cands: dict[str, Callable[[], object]], reps: int, inner: int
                 ) -> dict[str, dict[str, float]]:
    """{name: {"wall_s", "cpu_s"}}: medians per call over ``reps`` interleaved rounds."""
    for fn in cands.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in cands}
    cpu: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(reps):
        for name, fn in cands.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(inner):
                fn()
            wall[name].append((time.perf_counter() - t0) / inner)
            cpu[name].append((time.thread_time() - c0) / inner)
    return {k: {"wall_s": statistics.median(wall[k]), "cpu_s": statistics.median(cpu[k])}
            for k in cands}


def _pack_candidates(isa: str, lib: Any, x: torch.Tensor, y: torch.Tensor,
                     packed: torch.Tensor) -> dict[str, Callable[[], object]]:
    n = x.numel()
    return {f"pack/{isa}": lambda: lib.mb_pack(x.data_ptr(), n, packed.data_ptr()),
            f"worker/{isa}": lambda: lib.mb_worker(x.data_ptr(), y.data_ptr(), 0.1, n,
                                                   packed.data_ptr())}


def bench_pack(reps: int) -> list[dict[str, Any]]:
    """Sign packing and the worker step at each ISA level, one thread."""
    libs = {isa: _bitpack_c.load_isa(isa) for isa in _native.supported_isas()}
    libs = {k: v for k, v in libs.items() if v is not None}
    out = []
    for n in (1 << 16, 1 << 24):
        x, y = torch.randn(n), torch.randn(n)
        packed = torch.empty(n // 8, dtype=torch.uint8)
        cands: dict[str, Callable[[], object]] = {}
        for isa, lib in libs.items():
            cands.update(_pack_candidates(isa, lib, x, y, packed))
        inner = max(1, (1 << 24) // n)
        for name, t in _interleaved(cands, reps, inner).items():
            kernel, isa = name.split("/")
            out.append({"bench": "sign_pack", "kernel": kernel, "isa": isa, "n": n,
                        "gelem_s_wall": n / t["wall_s"] / 1e9,
                        "gelem_s_cpu": n / max(t["cpu_s"], 1e-9) / 1e9})
    return out


def _gemv_candidates(x: torch.Tensor, w: torch.Tensor, q8: qgemv.QWeight, q4: qgemv.QWeight,
                     threads: int) -> dict[str, tuple[Callable[[], object], int]]:
    n, k = w.shape
    xb, s_bf = x.bfloat16(), q8.s[:, 0].to(torch.bfloat16)
    cands: dict[str, tuple[Callable[[], object], int]] = {
        "torch fp32 mm": (lambda: x @ w.t(), 4 * n * k),
        "torch int8pack_mm (bf16 x)": (lambda: torch._weight_int8pack_mm(xb, q8.q, s_bf),
                                       q8.nbytes()),
    }
    for isa in _native.supported_isas():
        if _qgemv_c.load(isa) is None:
            continue
        cands[f"native int8 {isa}"] = (
            lambda isa=isa: qgemv.qgemm(x, q8, isa=isa, threads=threads), q8.nbytes())
        cands[f"native int4 g32 {isa}"] = (
            lambda isa=isa: qgemv.qgemm(x, q4, isa=isa, threads=threads), q4.nbytes())
    return cands


def bench_gemv(rows: list[int], n: int, k: int, reps: int, threads: int) -> list[dict[str, Any]]:
    """GB/s of weights read per kernel and row count."""
    torch.manual_seed(0)
    w = torch.randn(n, k)
    q8, q4 = qgemv.quantize_weight(w, 8, 0), qgemv.quantize_weight(w, 4, 32)
    inner = max(1, int(2e7 // (n * k)))
    out = []
    for r in rows:
        x = torch.randn(r, k)
        cands = _gemv_candidates(x, w, q8, q4, threads)
        times = _interleaved({name: fn for name, (fn, _) in cands.items()}, reps, inner)
        for name, t in times.items():
            nbytes = cands[name][1]
            out.append({"bench": "gemv", "kernel": name, "rows": r, "n": n, "k": k,
                        "threads": threads, "ms_wall": 1e3 * t["wall_s"],
                        "gb_s_wall": nbytes / t["wall_s"] / 1e9,
                        "gb_s_cpu": nbytes / max(t["cpu_s"], 1e-9) / 1e9})
    return out


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moebit bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,16", help="activation rows of the GEMV (comma list)")
    p.add_argument("--n", type=int, default=4096, help="output features of the GEMV weight")
    p.add_argument("--k", type=int, default=4096, help="input features of the GEMV weight")
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip", choices=("pack", "gemv"), action="append", default=[])
    p.add_argument("--json", default=None, help="write all results to this file")
    a = p.parse_args(argv)
    try:
        a.rows = [int(v) for v in a.rows.split(",") if v.strip()]
    except ValueError:
        p.error(f"--rows must be a comma list of integers, got {a.rows!r}")
    if not a.rows or min(a.rows) < 1 or min(a.n, a.k, a.reps, a.threads) < 1:
        p.error("--rows, --n, --k, --reps and --threads must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(a.threads)
    head = {"cpu": _native.cpu_model(), "isas": _native.supported_isas(),
            "torch": torch.__version__, "threads": a.threads, "reps": a.reps}
    print(f"# moebit bench kernels: {head['cpu']}, ISA levels {head['isas']}, "
          f"torch {head['torch']}, {a.threads} threads, medians of {a.reps} interleaved rounds")
    results: list[dict[str, Any]] = []
    if "pack" not in a.skip:
        torch.set_num_threads(1)
        for r in bench_pack(a.reps):
            results.append(r)
            print(f"sign {r['kernel']:<6s} {r['isa']:<8s} n=2^{r['n'].bit_length() - 1:<2d} "
                  f"{r['gelem_s_wall']:6.2f} Gelem/s wall  {r['gelem_s_cpu']:6.2f} cpu",
                  flush=True)
        torch.set_num_threads(a.threads)
    if "gemv" not in a.skip:
        for r in bench_gemv(a.rows, a.n, a.k, a.reps, a.threads):
            results.append(r)
            print(f"gemv rows={r['rows']:<3d} {r['kernel']:<28s} {r['ms_wall']:8.3f} ms  "
                  f"{r['gb_s_wall']:6.2f} GB/s wall  {r['gb_s_cpu']:6.2f} cpu", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**head, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
