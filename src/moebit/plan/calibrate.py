"""Measure this machine's rates for the performance model (``moebit plan --calibrate``).

- matmul rate: a float32 GEMM on one thread (what one CPU "device" does at best);
- model rate: moebit's own training step (forward, backward, clipping, Adam) of the given
  model on one rank, run by ``procs`` processes at once as the ranks of a real run would
  share the cores; its FLOPs over its time is the achieved device rate;
- 1-bit packing rate: OnebitAllreduce on one rank still compresses (worker pass, server
  pass, decode), so its time per element is the packing cost of a multi-rank call;
- update rate: one Adam step over a flat parameter;
- link alpha/beta: gloo allreduces on 127.0.0.1 between ``world`` processes, fitted to
  t = 2(W-1) alpha + 2(W-1)/W n / beta (the ring model collectives.py uses).

Short (a few seconds each) and noisy on a loaded host: report what was measured, when.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from moebit.comm.compressed import OnebitAllreduce
from moebit.models.registry import new_model
from moebit.training.config import TrainConfig, validate
from moebit.training.evaluation import autocast
from moebit.training.grads import clip_gradients
from moebit.training.setup import make_optimizer, param_groups


def _timeit(fn: Any, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(n: int = 384, reps: int = 10) -> float:
    """FLOP/s of an n x n float32 matmul on one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        return 2.0 * n**3 / _timeit(lambda: torch.mm(a, b), reps)
    finally:
        torch.set_num_threads(old)


def pack_rate(n: int = 1 << 20, reps: int = 5) -> float:
    """Elements/s of one pass of 1-bit packing (a world-1 call makes three passes)."""
    ar = OnebitAllreduce()
    x = torch.randn(n)
    out = torch.empty_like(x)
    return 3.0 * n / _timeit(lambda: ar.allreduce(x, "calib", out=out), reps)


def update_rate(n: int = 1 << 20, reps: int = 5) -> float:
    """Parameters/s of torch Adam's step on one flat parameter."""
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.Adam([p], lr=1e-3)
    return n / _timeit(opt.step, reps)


def _step_worker(cfg: TrainConfig, steps: int, q: Any) -> None:
    torch.set_num_threads(max(1, cfg.threads))
    torch.manual_seed(cfg.seed)
    model = new_model(cfg.model_config())
    opt = make_optimizer(cfg, param_groups(model, cfg))
    dev = torch.device("cpu")
    x = torch.randint(0, 256, (cfg.batch_size, cfg.model.block_size))
    y = torch.randint(0, 256, (cfg.batch_size, cfg.model.block_size))

    def step() -> None:
        with autocast(cfg.dtype, dev):
            out = model(x, y)
        opt.zero_grad(set_to_none=True)
        (out.loss + out.aux_loss).backward()
        clip_gradients(model, cfg.grad_clip)
        opt.step()

    q.put(_timeit(step, steps, warmup=3))


def model_step_seconds(cfg: TrainConfig, procs: int = 1, steps: int = 10) -> float:
    """Median seconds of moebit's training step on one rank, ``procs`` processes at once.

    Expert parallelism is set to 1 (one process holds every expert; the FLOPs per token
    are the same), the optimizer to Adam (the update is priced separately).
    """
    model = cfg.model
    if model.moe is not None:
        model = dataclasses.replace(model, moe=model.moe.replace(ep_size=1))
    one = validate(dataclasses.replace(cfg, model=model, optimizer="adam", extra={},
                                       threads=cfg.threads or 1))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_step_worker, args=(one, steps, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    try:
        times = [q.get(timeout=300) for _ in ps]
    finally:
        for p in ps:
            p.join(timeout=30)
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, q: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        out = []
        for n in sizes:
            t = torch.zeros(max(1, n // 4))
            dist.barrier()
            out.append(_timeit(lambda t=t: dist.all_reduce(t), reps))
        if rank == 0:
            q.put(out)
    finally:
        dist.destroy_process_group()


def link_alpha_beta(world: int = 2, sizes: list[int] | None = None, reps: int = 5) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of gloo's allreduce on loopback between ``world`` ranks."""
    sizes = sizes or [4 << 10, 64 << 10, 512 << 10, 2 << 20]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    ps = [ctx.Process(target=_link_worker, args=(r, world, port, sizes, reps, q))
          for r in range(world)]
    for p in ps:
        p.start()
    try:
        times = q.get(timeout=300)
    finally:
        for p in ps:
            p.join(timeout=30)
    a, b = _fit_line([float(s) for s in sizes], times)
    steps = 2 * (world - 1)
    if b <= 0:  # noise swamped the slope (a loaded host): the largest size's throughput
        b = times[-1] / sizes[-1]
        a = 0.0
    return max(a, 0.0) / steps, steps / (world * b)


def _fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((xi - mx) ** 2 for xi in x)
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y, strict=True)) / sxx
    return my - b * mx, b


def calibrate(world: int = 2, cfg: TrainConfig | None = None, procs: int | None = None) -> dict[str, Any]:
    """Every rate at once, with when and where it was measured."""
    out: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "matmul_flops": matmul_rate(), "pack_rate": pack_rate(), "update_rate": update_rate(),
    }
    out["link_alpha"], out["link_beta"] = link_alpha_beta(world)
    if cfg is not None:
        out["model_step_s"] = model_step_seconds(cfg, procs or world)
    return out
