"""The dense-side peers of ``moebit bench train --peers``: torch DDP with torch's own hooks.

Same model (moebit's GPT), data, seed, learning-rate schedule, clipping and evaluation as
``moebit train`` with Adam; only the gradient exchange differs: DDP with torch's PowerSGD
hook (``--peer powersgd``: low-rank, error feedback, warm start) or its fp16 compression
hook (``--peer fp16``). The run folder gets the same ``metrics.jsonl`` records, so bench
train measures every row alike.

    python -m moebit.bench.ddp_peer --peer powersgd --powersgd-rank 4 -- --nproc 4 --steps 300

Gloo and PowerSGD: with more than one DDP bucket, torch's PowerSGD hook fails on gloo with
a collective mismatch (buckets' allreduces are issued in different orders on different
ranks). On gloo this script therefore gives DDP one bucket (``bucket_cap_mb`` large
enough for every gradient), which also means no overlap of communication with the
backward pass there; on NCCL it keeps DDP's default buckets (``--bucket-cap-mb`` sets it).

DDP overlaps communication with the backward pass, so the time a step spends
communicating is not measured separately here (``comm_seconds_per_step`` is null). Bytes
are counted from the tensors' shapes the way each hook compresses them.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from moebit.bench.peer_log import PeerLog
from moebit.comm import stats
from moebit.comm.collectives import broadcast_params_, init_from_env
from moebit.models.gpt import GPT
from moebit.models.registry import new_model
from moebit.training.config import TrainConfig, build
from moebit.training.data import TrainBatches, check_block_size, load_corpus, val_batches
from moebit.training.evaluation import autocast, evaluate
from moebit.training.grads import clip_gradients
from moebit.training.setup import lr_at, make_optimizer, param_groups

PEERS = ("powersgd", "fp16")
ONE_BUCKET_MB = 1 << 14  # 16 GiB: every gradient of any model this runs lands in one bucket


def _counted(hook: Any, op: str, nbytes: Any) -> Any:
    """``hook`` that also records the bytes ``nbytes(state, bucket)`` the bucket puts on the wire."""
    def run(state, bucket):
        n = nbytes(state, bucket)
        moved = stats.ring_allreduce_bytes(n, dist.get_world_size())
        stats.record(op, moved, moved)
        return hook(state, bucket)
    return run


def _fp16_bytes(state: Any, bucket: dist.GradBucket) -> int:
    return 2 * bucket.buffer().numel()


def _powersgd_bytes(state: psgd.PowerSGDState, bucket: dist.GradBucket) -> int:
    """P and Q of each compressed matrix, every other tensor uncompressed (as the hook does);
    the whole bucket before ``start_powerSGD_iter``."""
    buf = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return buf.numel() * buf.element_size()
    total = 0
    for g in bucket.gradients():
        n = g.shape[0] if g.dim() > 1 else 1
        m = g.numel() // max(1, n)
        r = min(n, m, state.matrix_approximation_rank)
        small = g.dim() <= 1 or n * m <= (n + m) * r * state.min_compression_rate
        total += (g.numel() if small else (n + m) * r) * g.element_size()
    return total


def wrap(model: torch.nn.Module, peer: str, rank: int, start_iter: int,
         bucket_cap_mb: float | None) -> DDP:
    """DDP around ``model`` with the peer's hook (see the module docstring for gloo)."""
    if bucket_cap_mb is None and dist.get_backend() == "gloo":
        bucket_cap_mb = ONE_BUCKET_MB
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb) if bucket_cap_mb else DDP(model)
    if peer == "fp16":
        ddp.register_comm_hook(None, _counted(default_hooks.fp16_compress_hook, "ddp.fp16",
                                              _fp16_bytes))
    else:
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=max(2, start_iter),
                                   use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, _counted(psgd.powerSGD_hook, "ddp.powersgd",
                                               _powersgd_bytes))
    return ddp


def _step(ddp: DDP, model: GPT, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int,
          batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> float:
    for g in opt.param_groups:
        g["lr"] = lr_at(cfg, step)
    x, y = (t.to(device) for t in batch)
    with autocast(cfg.dtype, device):
        out = ddp(x, y)
    opt.zero_grad(set_to_none=True)
    (out.loss + out.aux_loss).backward()  # DDP averages the gradients through the hook
    clip_gradients(model, cfg.grad_clip)
    opt.step()
    return float(out.loss.detach())


def worker(cfg: TrainConfig, run_dir: Path, peer: str, rank: int, start_iter: int,
           bucket_cap_mb: float | None) -> None:
    info = init_from_env(cfg.device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data)
    check_block_size(corpus, cfg.model.block_size)
    model = new_model(cfg.model_config()).to(info.device)
    broadcast_params_(model)
    ddp = wrap(model, peer, rank, start_iter, bucket_cap_mb)
    opt = make_optimizer(cfg, param_groups(model, cfg))
    batches = TrainBatches(corpus.train, cfg.model.block_size, cfg.batch_size, cfg.seed, info.rank)
    vbatches = val_batches(corpus.val, cfg.model.block_size, cfg.batch_size, cfg.eval_batches, cfg.seed)
    log = PeerLog(run_dir, info.is_main, cfg, info.world_size,
                  lambda: evaluate(model, vbatches, cfg.dtype, info.device))
    log.start({"n_params": model.num_params(), "world_size": info.world_size,
               "optimizer": f"ddp-{peer}", "peer": peer, "powersgd_rank": rank,
               "threads": torch.get_num_threads()})
    model.train()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        loss = _step(ddp, model, opt, cfg, step, batches.next(), info.device)
        log.step(step, loss, time.perf_counter() - t0)
    log.end()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """One rank of a DDP peer run (started by ``python -m moebit.cli.ddp_peer``, through
    ``moebit.runs.runtime``, which calls this module's ``main``)."""
    ap = argparse.ArgumentParser(prog="python -m moebit.bench.ddp_peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=PEERS, required=True)
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--powersgd-start", type=int, required=True)
    ap.add_argument("--bucket-cap-mb", type=float, default=None)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--resolved-config", required=True)
    args = ap.parse_args(argv)
    path = Path(args.resolved_config)
    cfg = build(json.loads(path.read_text()), source=str(path))
    worker(cfg, path.parent, args.peer, args.powersgd_rank, args.powersgd_start, args.bucket_cap_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
