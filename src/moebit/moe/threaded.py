"""The "threaded" expert kernel: experts spread over CPU threads, one single-threaded GEMM each.

On CPU, torch's ``grouped_mm`` (and so transformers' ``grouped_mm`` experts) is a loop of
``mm`` calls, one per expert, each split by MKL over all intra-op threads. An expert's
block is small (128-512 rows of d 512 at the shapes of issue 16), and splitting such a
GEMM over threads costs a barrier per call: the threads wait for each other E times per
projection, and on a busy host a descheduled thread stalls the other. Here each expert
runs whole on one thread instead: ``torch.get_num_threads()`` workers take experts from
a shared queue (largest block first, so the last ones to finish are small), every GEMM
and activation single-threaded, and the threads meet once per forward and once per
backward. The arithmetic is the loop kernel's (``kernels.expert_forward`` /
``expert_backward``) on the same rows, so results equal the loop's bit for bit.

torch ops release the GIL, so Python threads run the GEMMs in parallel. While they run,
the intra-op thread count is 1 (``torch.set_num_threads``; restored afterwards): MKL's
thread count is process-wide, and at 2 threads each worker would start its own team.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from moebit.moe.kernels import loop_backward, loop_forward, row_slices

_POOL: ThreadPoolExecutor | None = None
_POOL_KEY: tuple[int, int] = (0, 0)  # (process id, workers): a forked child makes its own
_POOL_LOCK = threading.Lock()


def _one_thread() -> None:
    torch.set_num_threads(1)  # this worker's OpenMP teams: one thread


def _pool(n: int) -> ThreadPoolExecutor:
    """The worker pool of this process, of n threads (threads do not survive a fork)."""
    global _POOL, _POOL_KEY
    key = (os.getpid(), n)
    with _POOL_LOCK:
        if _POOL is None or _POOL_KEY != key:
            if _POOL is not None and _POOL_KEY[0] == key[0]:
                _POOL.shutdown(wait=True)
            _POOL = ThreadPoolExecutor(n, thread_name_prefix="moebit-experts",
                                       initializer=_one_thread)
            _POOL_KEY = key
        return _POOL


def run_experts(counts: list[int], job: Callable[[int, slice], None]) -> None:
    """``job(e, rows)`` for every expert, over ``torch.get_num_threads()`` worker threads.

    Experts are taken from one shared queue, largest first (dynamic scheduling balances
    uneven blocks and a thread the OS delays). Grad and inference mode are the caller's.
    """
    n_threads = torch.get_num_threads()
    slices = row_slices(counts)
    order = sorted(range(len(counts)), key=lambda e: -counts[e])
    if n_threads <= 1 or len(counts) <= 1:
        for e in order:
            job(e, slices[e])
        return
    lock, nxt = threading.Lock(), [0]
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def worker() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(order):
                    return
                job(order[i], slices[order[i]])

    pool = _pool(n_threads)
    torch.set_num_threads(1)
    try:
        futures = [pool.submit(worker) for _ in range(n_threads)]
        for f in futures:
            f.result()
    finally:
        torch.set_num_threads(n_threads)


class _ThreadedExperts(torch.autograd.Function):
    """The loop kernel's experts, run concurrently over worker threads (module docstring)."""

    @staticmethod
    def forward(ctx, x_ND, w_up, b_up, w_down, b_down, counts, grad_scale, kind):  # type: ignore[override]
        return loop_forward(ctx, run_experts, x_ND, w_up, b_up, w_down, b_down, counts,
                            grad_scale, kind)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_ND):  # type: ignore[override]
        return loop_backward(ctx, run_experts, g_ND)
