"""Run a function on N real gloo (or NCCL) ranks in spawned processes, with a hard timeout.

Used by the test suite (and usable by anyone testing code built on moebit): a hang
fails after ``timeout`` seconds instead of blocking, and a failing rank's traceback
is re-raised in the caller. Rendezvous goes through a ``file://`` store in a fresh
temporary folder, so concurrent runs never collide on a port.

    def body(rank, world, x):
        ...
        return result            # any picklable value; tensors are fine

    results = run_on_ranks(body, world=2, args=(3,), timeout=60)

``backend="nccl"`` puts rank r on CUDA device r % device_count (set as the current
device before the group starts): the body finds its device with
``torch.device("cuda", torch.cuda.current_device())``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    """A rank raised: the message holds its traceback."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    init_file: str,
    args: Sequence[Any],
    env: dict[str, str],
    out: Any,
    pg_timeout: float,
    backend: str,
) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    try:

        torch.set_num_threads(int(env.get("MOEBIT_TEST_THREADS", "1")))
        device = None
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
            device_id=device,
        )
        try:
            result = fn(rank, world, *args)
        finally:
            if dist.is_initialized():  # fn may have torn it down itself
                dist.destroy_process_group()
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - the traceback is the product here
        out.put((rank, False, traceback.format_exc()))


# torch._dynamo: every torch optimizer imports it on construction (its methods are wrapped
# in torch._disable_dynamo), seconds per rank that the fork server then pays once.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "moebit.training.loop"]
_ctx: Any = None


def _context() -> Any:
    """A forkserver that imported torch once: each rank forks from it in milliseconds.

    A plain fork of the caller is unsafe (its OpenMP pool may be live); spawn re-imports
    torch in every rank, seconds each on a loaded 2-core machine. The fork server never
    runs tensor math, so forking it is safe, and it serves every call of this process.
    """
    global _ctx
    if _ctx is None:
        if "forkserver" in mp.get_all_start_methods():
            _ctx = mp.get_context("forkserver")
            _ctx.set_forkserver_preload(_PRELOAD)
        else:  # pragma: no cover - non-POSIX
            _ctx = mp.get_context("spawn")
    return _ctx


def run_on_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return the results by rank.

    ``fn`` must be importable by name (defined at module level). Raises ``RankFailed``
    with the first failing rank's traceback, or ``TimeoutError`` if the ranks have not
    all finished within ``timeout`` seconds (all of them are then killed).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = _context()
    out = ctx.Queue()
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="moebit-ranks-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world, init_file, tuple(args), dict(env or {}), out, timeout,
                      backend),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{world - len(results)} of {world} ranks did not finish within "
                        f"{timeout:.0f}s (finished: {sorted(results)})"
                    )
                try:
                    rank, ok, payload = out.get(timeout=min(left, 0.5))
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)
                    ]
                    if dead:
                        # A rank died without reporting (killed, segfault): give the queue a
                        # moment in case its message is in flight, then fail.
                        try:
                            rank, ok, payload = out.get(timeout=1.0)
                        except queue.Empty:
                            raise RankFailed(
                                f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                "without a result"
                            ) from None
                    else:
                        continue
                if not ok:
                    raise RankFailed(f"rank {rank} failed:\n{payload}")
                results[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    return [results[r] for r in range(world)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun rendezvous)."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
