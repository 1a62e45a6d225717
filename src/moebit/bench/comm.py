"""``moebit bench comm``: allreduce methods timed over ranks x sizes, optionally on a slow link.

    python -m moebit.bench.comm --ranks 2,4 --sizes 1M,32M --link 1gbit --json comm.json

Methods (each rank holds a different random float32 buffer of n elements):

- ``fp32``: ``dist.all_reduce`` of the buffer, divided by W (the baseline);
- ``fp16``: cast to fp16, ``all_reduce``, cast back (what an fp16-compression hook does);
- ``onebit``: ``OnebitAllreduce.allreduce`` end to end, packing and unpacking included;
- ``onebit-wire``: the same collectives on pre-packed buffers, no compute (the floor);
- ``powersgd``: torch's PowerSGD DDP hook (rank 1, error feedback) on one parameter of the
  buffer's size viewed as a matrix, timed as a DDP backward pass; ``onebit-ddp`` is
  moebit's 1-bit hook in the same DDP setting, for comparison.

Each rank is its own process launched by ``torch.distributed.run`` with ``--threads`` CPU
threads. A repetition starts after a barrier and ends when the slowest rank is done; the
table shows the median over repetitions, the bytes each rank sent per call (counted by
``moebit.comm.stats``), and the speed-up over fp32 measured in the same run. ``--link RATE``
runs all ranks in a private network namespace whose loopback is shaped to RATE
(``moebit.bench.netns``; needs root).

``--device cuda`` keeps every buffer on the rank's GPU (rank r on device r % count) and
synchronizes before each time is taken. The backend is NCCL when there is a GPU per
rank and gloo (on the same CUDA tensors) otherwise, as NCCL refuses two ranks on one GPU;
``--backend`` overrides the choice. The table's header names the pair used.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from moebit.bench.netns import ShapedLinkUnavailable, _require_tools, parse_rate, run_in_shaped_netns
from moebit.comm import bitpack, stats
from moebit.comm.collectives import all_gather_flat
from moebit.comm.compressed import OnebitAllreduce, padded_length
from moebit.comm.hooks import OnebitHookState, onebit_hook
from moebit.testing import free_port

METHODS = ("fp32", "fp16", "onebit", "onebit-wire", "powersgd", "onebit-ddp")


def parse_size(text: str) -> int:
    """'32M' -> 33554432 (binary multiples), '1000' -> 1000."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        msg = f"cannot read size {text!r}: use e.g. 1M, 32M, 4096"
        raise argparse.ArgumentTypeError(msg) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda s: [kind(v) for v in s.split(",") if v.strip()]


def _method(name: str) -> str:
    if name not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {name!r}; choose from {METHODS}")
    return name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moebit bench comm", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=_csv(int), default=[2, 4], help="world sizes, e.g. 2,4")
    p.add_argument("--sizes", type=_csv(parse_size), default=[32 << 20],
                   help="float32 elements per rank, e.g. 1M,32M")
    p.add_argument("--methods", type=_csv(_method), default=list(METHODS),
                   help=f"comma list of {','.join(METHODS)}")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--link", default=None, help="shape loopback to this rate, e.g. 1gbit")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the buffers live (cuda: rank r on GPU r %% count)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl on CUDA with a GPU per rank, else gloo")
    p.add_argument("--bitpack", action="store_true",
                   help="only time sign packing/unpacking on one thread, in this process")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: result file
    return p


# ---------------------------------------------------------------- inside each rank


def _matrix_shape(n: int) -> tuple[int, int]:
    rows = 1
    while rows * rows * 4 <= n and n % (rows * 2) == 0:
        rows *= 2
    return rows, n // rows


def _worker(args: argparse.Namespace) -> None:


    torch.set_num_threads(args.threads)
    world = int(os.environ["WORLD_SIZE"])
    dev, backend = _device_and_backend(args.device, args.backend, world,
                                       int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    rank = dist.get_rank()
    results = []
    bar = None
    if rank == 0:

        bar = tqdm(total=len(args.sizes) * len(args.methods), desc=f"{world} ranks",
                   file=sys.stderr, leave=True)
    for n in args.sizes:
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(n, generator=gen).to(dev)
        for method in args.methods:
            if bar is not None:
                bar.set_postfix_str(f"n={n} {method}")
            step = _make_step(method, x, world)
            times, per_call = _time(step, args.warmup, args.reps, stats, dist, dev)
            if rank == 0:
                results.append({
                    "ranks": world, "size": n, "method": method, "device": dev.type,
                    "backend": backend,
                    "median_s": statistics.median(times), "min_s": min(times), "times_s": times,
                    "bytes_sent_per_rank": per_call,
                })
            del step
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
        with open(args.worker, "w") as f:
            json.dump(results, f)
    # the DDP steps' models, reducers and hook states sit in reference cycles: free them
    # while the process group is alive, not during interpreter teardown (where a gloo
    # reducer freed late aborted one rank with "terminate called without an active
    # exception" once in CI)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    _ = OnebitAllreduce  # imported above so a broken install fails before timing


def _device_and_backend(device: str, backend: str, world: int, local_rank: int):
    """This rank's device and the process-group backend for ``--device`` / ``--backend``."""

    if device == "cpu":
        if backend == "nccl":
            raise SystemExit("moebit bench comm: --backend nccl needs --device cuda")
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise SystemExit("moebit bench comm: --device cuda, but no CUDA device is visible")
    count = torch.cuda.device_count()
    if backend == "auto":
        backend = "nccl" if count >= world else "gloo"
    return torch.device("cuda", local_rank % count), backend


def _sync(dev) -> None:

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(step, warmup: int, reps: int, stats, dist, dev=None) -> tuple[list[float], float]:

    dev = dev or torch.device("cpu")
    for _ in range(warmup):
        step()
    _sync(dev)
    times = []
    before = stats.snapshot()
    on = dev if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces device tensors only
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        _sync(dev)
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=on)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a rep ends when the slowest rank does
        times.append(float(mine))
    moved = stats.snapshot().minus(before)
    return times, moved.bytes_sent / reps


def _make_step(method: str, x, world: int) -> Callable[[], None]:


    n = x.numel()
    if method in ("fp32", "fp16"):
        dtype = torch.float32 if method == "fp32" else torch.float16
        buf = torch.empty(n, dtype=dtype, device=x.device)
        moved = stats.ring_allreduce_bytes(n * buf.element_size(), world)

        def step() -> None:
            t0 = time.perf_counter()
            buf.copy_(x)
            dist.all_reduce(buf)
            buf.div_(world)
            stats.record(f"bench.{method}", moved, moved, time.perf_counter() - t0)

        return step
    if method == "onebit":
        ar, out = OnebitAllreduce(), torch.empty_like(x)

        def onebit() -> None:
            ar.allreduce(x, "bench", out=out)

        return onebit
    if method == "onebit-wire":
        cb = padded_length(n, world) // world // 8
        send = torch.randint(0, 256, (world, cb + 4), dtype=torch.uint8).to(x.device)
        recv, send2, recv2 = torch.empty_like(send), send[0].clone(), torch.empty_like(send)
        mine = torch.tensor([n], device=x.device)
        every = torch.empty(world, dtype=torch.int64, device=x.device)

        def wire() -> None:
            t0 = time.perf_counter()
            all_gather_flat(every, mine)
            dist.all_to_all_single(recv.view(-1), send.view(-1))
            all_gather_flat(recv2.view(-1), send2)
            moved = 8 * (world - 1) + 2 * (world - 1) * (cb + 4)
            stats.record("bench.onebit-wire", moved, moved, time.perf_counter() - t0)

        return wire
    return _ddp_step(method, x, world)


def _ddp_step(method: str, x, world: int) -> Callable[[], None]:
    """One DDP backward over a single [rows, cols] parameter whose gradient is x."""


    class Inject(torch.autograd.Function):
        """Forward: a scalar; backward: hands ``g`` to the parameter as its gradient.

        So a step costs DDP's bookkeeping plus the hook, not a model's arithmetic.
        """

        @staticmethod
        def forward(ctx, w, g):
            ctx.g = g
            return w.new_zeros(())

        @staticmethod
        def backward(ctx, grad_out):
            return ctx.g, None

    rows, cols = _matrix_shape(x.numel())
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(rows, cols, device=x.device))
    model.forward = lambda g: Inject.apply(model.w, g)
    # The gradient is the bucket (no copies in and out): DDP overhead kept to a minimum.
    ddp = DDP(model, bucket_cap_mb=x.numel() * 4 / 2**20 + 1, gradient_as_bucket_view=True,
              device_ids=[x.device] if x.device.type == "cuda" else None)
    if method == "powersgd":
        rank_r = 1
        state = psgd.PowerSGDState(None, matrix_approximation_rank=rank_r,
                                   start_powerSGD_iter=2, min_compression_rate=1)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        # PowerSGD allreduces P [rows, r] and Q [cols, r] in fp32 each step.
        moved = stats.ring_allreduce_bytes(4 * (rows + cols) * rank_r, world)
    else:
        state = OnebitHookState(None, start_iter=2)
        ddp.register_comm_hook(state, onebit_hook)
        moved = 0  # counted inside the 1-bit allreduce
    g = x.view(rows, cols)
    its = [0]
    for _ in range(3):  # past start_iter, so the timed steps compress
        ddp.zero_grad(set_to_none=False)
        ddp(g).backward()
        its[0] += 1

    def step() -> None:
        t0 = time.perf_counter()
        ddp.zero_grad(set_to_none=False)
        ddp(g).backward()
        if method == "powersgd" and its[0] >= 2:
            stats.record("bench.powersgd", moved, moved, time.perf_counter() - t0)
        its[0] += 1

    return step


# ---------------------------------------------------------------- the driver


def _launch(args: argparse.Namespace, world: int, out_file: str) -> None:

    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "moebit.bench.comm",
        "--sizes", ",".join(str(s) for s in args.sizes), "--methods", ",".join(args.methods),
        "--reps", str(args.reps), "--warmup", str(args.warmup),
        "--threads", str(args.threads), "--device", args.device, "--backend", args.backend,
        "--worker", out_file,
    ]
    env = {"OMP_NUM_THREADS": str(args.threads)}
    if args.link:

        res = run_in_shaped_netns(argv, args.link, env=env, timeout=args.timeout)
    else:
        res = subprocess.run(argv, env={**os.environ, **env}, timeout=args.timeout)
    if res.returncode != 0:
        raise RuntimeError(f"benchmark ranks (world {world}) exited with {res.returncode}")


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    base = {(r["ranks"], r["size"]): r["median_s"] for r in rows if r["method"] == "fp32"}
    for r in rows:
        b = base.get((r["ranks"], r["size"]))
        r["speedup_vs_fp32"] = b / r["median_s"] if b else None
        if r["method"].startswith("onebit"):
            ideal = 2 * (r["ranks"] - 1) / r["ranks"] * r["size"] / 8
            r["bytes_vs_ideal_1bit"] = r["bytes_sent_per_rank"] / ideal
    wire = {(r["ranks"], r["size"]): r["median_s"] for r in rows if r["method"] == "onebit-wire"}
    for r in rows:
        w = wire.get((r["ranks"], r["size"]))
        if r["method"] == "onebit" and w:
            r["vs_wire"] = r["median_s"] / w


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'ranks':>5} {'elements':>10} {'method':<12} {'median s':>9} {'MB sent/rank':>12} " \
           f"{'x fp32':>7} {'bytes/ideal':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        sp = r.get("speedup_vs_fp32")
        ideal = r.get("bytes_vs_ideal_1bit")
        lines.append(
            f"{r['ranks']:>5} {r['size']:>10} {r['method']:<12} {r['median_s']:>9.4f} "
            f"{r['bytes_sent_per_rank'] / 1e6:>12.3f} {(f'{sp:.2f}' if sp else '-'):>7} "
            f"{(f'{ideal:.3f}' if ideal else '-'):>11}"
        )
    return "\n".join(lines)


def _bitpack_cases(n: int) -> dict[str, Callable[[], object]]:


    x = torch.randn(n)
    packed = bitpack.pack_signs(x)
    out = torch.empty(n)
    xn = x.numpy()
    return {
        "pack_signs": lambda: bitpack.pack_signs(x),
        "unpack (into a buffer)": lambda: bitpack.unpack_scaled(packed, n, 1.0, out=out),
        "unpack_signs (new tensor)": lambda: bitpack.unpack_signs(packed, n),
        "torch.empty + fill (reference)": lambda: torch.empty(n).fill_(1.0),
        "numpy packbits (reference)": lambda: np.packbits(xn >= 0, bitorder="little"),
    }


def _bitpack_bench(args: argparse.Namespace) -> int:
    """Elements per second of pack and unpack on one thread (the issue's 3 G/s target)."""


    torch.set_num_threads(1)
    rows = []
    for n in args.sizes:
        cases = _bitpack_cases(n)
        for what, fn in cases.items():
            fn()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            rows.append({"size": n, "op": what, "median_s": med, "g_elements_per_s": n / med / 1e9})
    path = "native" if bitpack.native_available() else "portable (torch/numpy)"
    print(f"bit packing on one thread, {path} path")
    for r in rows:
        print(f"{r['size']:>10} {r['op']:<28} {r['median_s'] * 1e3:8.2f} ms "
              f"{r['g_elements_per_s']:6.2f} G elements/s")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"path": path, "results": rows}, f, indent=1)
    return 0


def _torch_version() -> str:

    return torch.__version__


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.bitpack:
        return _bitpack_bench(args)
    if args.device == "cuda" or args.backend == "nccl":

        if args.device != "cuda" or not torch.cuda.is_available():
            why = ("--backend nccl needs --device cuda" if args.device != "cuda"
                   else "--device cuda, but no CUDA device is visible")
            print(f"moebit bench comm: {why}", file=sys.stderr)
            return 2
    if args.link:

        try:  # fail before any rank starts; never run unshaped
            parse_rate(args.link)
            _require_tools()
        except (ValueError, ShapedLinkUnavailable) as e:
            print(f"moebit bench comm: --link {args.link}: {e}", file=sys.stderr)
            return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moebit-bench-") as tmp:
        for world in args.ranks:
            out_file = os.path.join(tmp, f"w{world}.json")
            _launch(args, world, out_file)
            with open(out_file) as f:
                rows.extend(json.load(f))
    _add_ratios(rows)
    used = sorted({f"{r['device']}/{r['backend']}" for r in rows})
    print(f"link: {args.link or 'loopback (unshaped)'}, threads per rank: {args.threads}, "
          f"device/backend: {', '.join(used)}")
    print(format_table(rows))
    if args.json_path:
        doc = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "torch": _torch_version()},
            "args": {k: v for k, v in vars(args).items() if k != "worker"},
            "results": rows,
        }
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
