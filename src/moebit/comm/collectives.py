"""Process-group setup from torchrun's environment, and the few collectives every part shares.

Ranks are launched by ``torch.distributed.run`` (``moebit train --nproc N`` wraps it),
so everything here reads the standard ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` variables.
A single process without those variables runs as world size 1 with no process group.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moebit.comm import stats

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when running without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but CUDA is not available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if requested != "cpu":
        raise ValueError(f"unknown device {requested!r}: expected auto, cpu or cuda")
    return torch.device("cpu")


def init_from_env(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Join the process group torchrun set up (or run alone when there is none).

    The collective timeout is what turns a dead peer into an error instead of a hang.
    """
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        dev = pick_device(device, local)
        return DistInfo(rank, world, local, dev, dist.get_backend())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return DistInfo(0, 1, 0, dev, None)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend_for(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, store=_attempt_store(rank, world, timeout), rank=rank, world_size=world,
        timeout=timeout, device_id=dev if dev.type == "cuda" else None,
    )
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, dev, backend)


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this restart attempt.

    After torchrun restarts failed ranks (``--max-restarts``) the new ranks meet in the
    same store; without a per-attempt prefix a rank can read a dead peer's old address
    and fail with "connection refused", or connect to a stranger and hang.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    else:
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                              multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"moebit/attempt_{attempt}", store)


def world_size(group: dist.ProcessGroup | None = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group: dist.ProcessGroup | None = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def all_gather_flat(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """Gather equal-sized 1-D tensors from every rank into ``out``, rank-major.

    torch 2.13 deprecates ``all_gather_into_tensor`` for ``all_gather_single``, which older
    releases lack: the choice lives here only.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def allreduce_mean_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = 64 << 20,
    op_name: str = "allreduce",
) -> None:
    """Average tensors in place over ``group`` with few large allreduces.

    Tensors are flattened into buckets of about ``bucket_bytes`` per dtype: each
    collective pays a network round trip, so one per parameter would be slow.
    Gloo has no ReduceOp.AVG, so this sums and divides.
    """
    w = world_size(group)
    if w == 1:
        return
    for i, bucket in enumerate(_buckets(tensors, bucket_bytes)):
        flat = _flat_buffer(i, bucket)
        torch.cat([t.reshape(-1) for t in bucket], out=flat)
        t0 = time.perf_counter()
        dist.all_reduce(flat, group=group)
        nbytes = flat.numel() * flat.element_size()
        moved = stats.ring_allreduce_bytes(nbytes, w)
        stats.record(op_name, moved, moved, time.perf_counter() - t0)
        flat.div_(w)
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


_flat_cache: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _flat_buffer(index: int, bucket: list[torch.Tensor]) -> torch.Tensor:
    """A reused flat buffer for bucket ``index``: a fresh 40 MB tensor per step costs
    tens of milliseconds of page faults on CPU, as much as the allreduce on loopback."""
    n = sum(t.numel() for t in bucket)
    key = (index, n, bucket[0].dtype, bucket[0].device)  # one per group layout, reused
    buf = _flat_cache.get(key)
    if buf is None:
        buf = _flat_cache[key] = torch.empty(n, dtype=bucket[0].dtype, device=bucket[0].device)
    return buf


def _buckets(tensors: Iterable[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    by_key: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        lists = by_key.setdefault(key, [[]])
        nbytes = t.numel() * t.element_size()
        if lists[-1] and sizes.get(key, 0) + nbytes > bucket_bytes:
            lists.append([])
            sizes[key] = 0
        lists[-1].append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [b for lists in by_key.values() for b in lists if b]


def broadcast_params_(module: torch.nn.Module, src: int = 0,
                      expert_dp_group: dist.ProcessGroup | None = None,
                      expert_src: int | None = None,
                      is_expert: Callable[[torch.Tensor], bool] | None = None) -> None:
    """Make every rank start from the same weights.

    Dense parameters and buffers come from rank ``src``. Expert parameters (those for
    which ``is_expert`` holds) differ between expert-parallel ranks (each holds other
    experts): with ``expert_dp_group`` they come from ``expert_src`` (a global rank)
    within that group, which holds the same experts on every member.

    Ranks built from the same seed already agree, and between nodes a broadcast of the
    whole model is the largest thing a low-communication run ever sends (the model once per
    remote rank, more than DiLoCo's outer syncs of a short run). So each part is first
    compared by a digest of its bytes (16 bytes on the wire) and only broadcast when some
    rank holds other values.
    """
    if world_size() == 1:
        return
    expert = expert_src is not None and is_expert is not None
    dense = [p.data for p in module.parameters() if not (expert and is_expert(p))]  # type: ignore[misc]
    dense += [b.data for b in module.buffers()]
    if not same_on_all(dense):
        for t in dense:
            dist.broadcast(t, src=src)
    if expert:
        experts = [p.data for p in module.parameters() if is_expert(p)]  # type: ignore[misc]
        if not same_on_all(experts, expert_dp_group):
            for t in experts:
                dist.broadcast(t, src=expert_src, group=expert_dp_group)  # type: ignore[arg-type]


def tensors_digest(tensors: Sequence[torch.Tensor]) -> int:
    """A 63-bit digest of the tensors' shapes, dtypes and bytes (blake2b), equal on two
    ranks exactly when they hold the same values (up to hash collisions)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        c = t.detach().contiguous().cpu()
        h.update(c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1


def same_on_all(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank of ``group`` holds bitwise the same ``tensors``: one allreduce of
    the digest and its negation (MAX gives the largest and minus the smallest)."""
    d = tensors_digest(tensors)
    nccl = dist.get_backend(group) == "nccl"
    t = torch.tensor([d, -d], dtype=torch.int64,
                     device=tensors[0].device if nccl and tensors else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0]) == d == -int(t[1])
