"""The torchft peer of ``moebit bench train --peers torchft_diloco``: torchft's DiLoCo.

``torchft.local_sgd.DiLoCo`` (torchft 0.2, the open implementation) on moebit's model,
data, seed, learning-rate schedule, clipping and evaluation, as the DDP peers
(``moebit.bench.ddp_peer``) and ``moebit train --outer diloco --outer-group world``: every
rank is its own replica group (one ``torchft.Manager`` each, world size 1), the inner
optimizer is moebit's AdamW, the outer one ``torch.optim.SGD`` with the run's
``--outer-lr``, ``--outer-momentum`` and ``--outer-nesterov``, syncing every
``--outer-every`` steps. Rank 0 runs the lighthouse (torchft's quorum server) and tells
the others its address through the launcher's store.

What runs and what does not on gloo / CPU: torchft's ``ProcessGroupGloo`` and DiLoCo's
fp32 pseudo-gradient allreduce run; its quantized allreduce (``should_quantize``,
torchft/collectives.py and quantization.py) is written in Triton for CUDA tensors, and
where ``import triton`` fails ``torchft.Manager.allreduce`` silently sends fp32 instead.
So ``--outer-compress`` other than ``none`` is refused with that reason, and so is
Streaming (``--outer-fragments``
> 1): this peer gives torchft one fragment, the whole model. Any failure of torchft
itself (not installed, a quorum that does not form) ends the rank with one line in
``RUN/peer_error.txt``, which ``moebit bench train`` reports as the row's reason.

Bytes: torchft's collectives bypass ``moebit.comm.stats``, so each allreduce the DiLoCo
object issues through its manager is recorded from the tensor's shape (ring allreduce
bytes over the replica groups), under the kind ``outer``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moebit.bench.peer_log import PeerLog
from moebit.comm import stats
from moebit.comm.collectives import broadcast_params_, init_from_env
from moebit.models.registry import new_model
from moebit.training.config import TrainConfig, build
from moebit.training.data import TrainBatches, check_block_size, load_corpus, val_batches
from moebit.training.evaluation import autocast, evaluate
from moebit.training.grads import clip_gradients
from moebit.training.setup import lr_at, make_optimizer, param_groups

ERROR_FILE = "peer_error.txt"
TIMEOUT = timedelta(seconds=120)


def unsupported(cfg: TrainConfig) -> str | None:
    """Why torchft's DiLoCo cannot run this configuration on CPU, or None."""
    if cfg.outer_compress != "none":
        return (f"torchft DiLoCo: --outer-compress {cfg.outer_compress} needs torchft's "
                "quantized allreduce (should_quantize: Triton kernels for CUDA tensors, "
                "torchft/collectives.py and quantization.py); without triton torchft.Manager "
                "sends fp32 instead (IS_TRITON_AVAILABLE False), so only none runs on gloo/CPU")
    if cfg.outer_fragments > 1:
        return "torchft DiLoCo: this peer gives torchft one fragment (--outer-fragments 1)"
    if cfg.moe is not None and cfg.moe.ep_size > 1:
        return "torchft DiLoCo: the peer runs without expert parallelism (--ep-size 1)"
    return None


def _counting(manager: Any, replicas: int) -> None:
    """Record the bytes of every allreduce ``manager`` issues (fp32, ring over the
    replica groups) in moebit's stats, kind ``outer``."""
    allreduce = manager.allreduce

    def counted(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        moved = stats.ring_allreduce_bytes(tensor.numel() * tensor.element_size(), replicas)
        stats.record("outer.torchft", moved, moved)  # asynchronous: no time of its own
        return allreduce(tensor, *args, **kw)

    manager.allreduce = counted


def _own_addr() -> str:
    """This rank's address for torchft's servers: loopback on one machine; on an emulated
    node (``moebit.bench.twonode`` sets GLOO_SOCKET_IFNAME) the node's own address, which
    its namespace's hosts file gives the hostname, so the other node can reach it."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def _manager(model: torch.nn.Module, inner: torch.optim.Optimizer, rank: int, world: int) -> Any:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum logs every step at info
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    lighthouse = None
    host = _own_addr()
    addr = [None]
    if rank == 0:
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world)
        addr = [f"http://{host}:{lighthouse.address().rsplit(':', 1)[1]}"]
    dist.broadcast_object_list(addr, src=0)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner_optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=world,
                      use_async_quorum=False, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"moebit{rank}", store_addr=host,
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=addr[0],
                      hostname=host, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
                      connect_timeout=TIMEOUT, init_sync=False)
    _counting(manager, world)
    return manager, lighthouse, store


def _train(cfg: TrainConfig, run_dir: Path, info: Any) -> None:
    from torchft.local_sgd import DiLoCo

    corpus = load_corpus(cfg.data)
    check_block_size(corpus, cfg.model.block_size)
    model = new_model(cfg.model_config()).to(info.device)
    # Every replica starts from rank 0's weights, so torchft need not heal at step 0
    # (init_sync=False): its checkpoint server names itself by socket.gethostname(), which
    # on an emulated node resolves to the asking node's own address.
    broadcast_params_(model)
    inner = make_optimizer(cfg, param_groups(model, cfg))
    outer = torch.optim.SGD(model.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                            nesterov=cfg.outer_nesterov and cfg.outer_momentum > 0)
    manager, lighthouse, store = _manager(model, inner, info.rank, info.world_size)
    batches = TrainBatches(corpus.train, cfg.model.block_size, cfg.batch_size, cfg.seed, info.rank)
    vbatches = val_batches(corpus.val, cfg.model.block_size, cfg.batch_size, cfg.eval_batches, cfg.seed)
    log = PeerLog(run_dir, info.is_main, cfg, info.world_size,
                  lambda: evaluate(model, vbatches, cfg.dtype, info.device))
    log.start({"n_params": model.num_params(), "world_size": info.world_size,
               "optimizer": "torchft-diloco", "peer": "torchft_diloco",
               "outer_every": cfg.outer_every, "threads": torch.get_num_threads()})
    model.train()
    with DiLoCo(manager, [model], inner, outer, sync_every=cfg.outer_every,
                backup_device=torch.device("cpu"), pin_memory=False):
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            for g in inner.param_groups:
                g["lr"] = lr_at(cfg, step)
            x, y = (t.to(info.device) for t in batches.next())
            with autocast(cfg.dtype, info.device):
                out = model(x, y)
            inner.zero_grad(set_to_none=True)
            (out.loss + out.aux_loss).backward()  # no per-step exchange: each rank is a worker
            clip_gradients(model, cfg.grad_clip)
            inner.step()  # torchft's post-step hook syncs every sync_every steps
            log.step(step, float(out.loss.detach()), time.perf_counter() - t0)
    log.end()
    dist.barrier()  # the lighthouse (rank 0) outlives every replica's last quorum
    manager.shutdown(wait=False)
    del store, lighthouse


def worker(cfg: TrainConfig, run_dir: Path) -> int:
    info = init_from_env(cfg.device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
    torch.manual_seed(cfg.seed)
    reason = unsupported(cfg)
    try:
        if reason is None:
            _train(cfg, run_dir, info)
    except Exception as e:  # noqa: BLE001 - the row's reason, in one line
        reason = f"torchft DiLoCo failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if reason is not None:
        if info.is_main:
            (run_dir / ERROR_FILE).write_text(reason + "\n")
        print(f"torchft peer: {reason}", file=sys.stderr, flush=True)
        return 1
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    """One rank (started by ``python -m moebit.cli.ddp_peer --peer torchft_diloco``)."""
    ap = argparse.ArgumentParser(prog="python -m moebit.bench.torchft_peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--resolved-config", required=True)
    args, _ = ap.parse_known_args(argv)
    path = Path(args.resolved_config)
    cfg = build(json.loads(path.read_text()), source=str(path))
    return worker(cfg, path.parent)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
