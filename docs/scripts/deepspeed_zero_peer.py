"""DeepSpeed ZeRO-2/3 on CPU + gloo as the peer of docs/benchmarks/sharding.md: tokens/s,
model-state bytes and peak RSS per rank, on moebit's GPT.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 4 docs/scripts/deepspeed_zero_peer.py 3 \
        --n-layer 4 --n-head 4 --d-model 256 --block-size 64 --batch-size 2 --steps 20 \
        --measure-from 10

The model, batch and block are `moebit train`'s (`--n-layer` ...; 1 torch thread per
rank), each rank its own random batches (tokens/s does not depend on their text), torch's
AdamW as a client optimizer (DeepSpeed's own CPU Adam would JIT-compile a kernel first),
fp32. Tokens/s counts all ranks' tokens over the steps after `--measure-from`, as
`moebit bench train` does. State bytes: this rank's share of parameters, gradients and
AdamW's two moments as DeepSpeed partitions them (ZeRO-2: full parameters, 1/W of
gradients and moments; ZeRO-3: 1/W of all three), counted from the tensors the engine
holds. DeepSpeed JIT-compiles its shared-memory comm op on first use (23 minutes on a
loaded 2-core host, under a minute on a quiet one).
"""
import argparse
import json
import resource
import time

import deepspeed
import torch

from moebit.models.gpt import GPT, GPTConfig

ap = argparse.ArgumentParser()
ap.add_argument("stage", type=int, choices=(2, 3))
ap.add_argument("--n-layer", type=int, default=2)
ap.add_argument("--n-head", type=int, default=2)
ap.add_argument("--d-model", type=int, default=64)
ap.add_argument("--block-size", type=int, default=32)
ap.add_argument("--batch-size", type=int, default=2)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--measure-from", type=int, default=1)
args = ap.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                      block_size=args.block_size))
n_params = sum(p.numel() for p in model.parameters())
cfg = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
       "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": args.stage},
       "fp16": {"enabled": False}, "bf16": {"enabled": False}}
deepspeed.init_distributed(dist_backend="gloo")
opt0 = torch.optim.AdamW(model.parameters(), lr=1e-3)  # a client optimizer: no CPU Adam JIT
engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt0, config=cfg)
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
t_measure = None
for step in range(1, args.steps + 1):
    if step == args.measure_from + 1:
        torch.distributed.barrier()
        t_measure = time.perf_counter()
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 256, (args.batch_size, args.block_size + 1), generator=g)
    out = engine(x[:, :-1], x[:, 1:])
    engine.backward(out.loss)
    engine.step()
    if rank == 0 and step % 5 == 0:
        print(f"stage {args.stage} step {step} loss {out.loss.item():.4f}", flush=True)
torch.distributed.barrier()
wall = time.perf_counter() - t_measure
tokens = (args.steps - args.measure_from) * args.batch_size * args.block_size * world


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


# what this rank holds: ZeRO-3 keeps a 1/W partition of each parameter (ds_tensor), ZeRO-2
# the whole parameters; the optimizer's flat fp32 partitions and their moments are 1/W
params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
flat = getattr(opt, "single_partition_of_fp32_groups", None) or \
    getattr(opt, "fp32_partitioned_groups_flat", [])
moments = [v for s in opt.optimizer.state.values() for v in s.values()
           if torch.is_tensor(v) and v.dim() > 0]
grads = [p.grad for p in flat]
state = nbytes(params) + nbytes(flat if args.stage == 2 else []) + nbytes(moments) + \
    (nbytes(grads) or nbytes(flat))
rec = {"stage": args.stage, "ranks": world, "params": n_params, "tokens_per_s": tokens / wall,
       "state_bytes_per_rank": state, "params_bytes_per_rank": nbytes(params),
       "moments_bytes_per_rank": nbytes(moments),
       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
       "last_loss": out.loss.item()}
if rank == 0:
    print(json.dumps(rec), flush=True)
