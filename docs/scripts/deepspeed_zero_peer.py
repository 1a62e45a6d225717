"""DeepSpeed ZeRO-2/3 on CPU + gloo: does it run? (the peer check of docs/benchmarks/sharding.md)

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 docs/scripts/deepspeed_zero_peer.py 3

moebit's GPT (2 layers, d_model 64), each rank its own batches, torch's AdamW as a client
optimizer (DeepSpeed's own CPU Adam would JIT-compile first), 3 steps; rank 0 prints the
loss. DeepSpeed JIT-compiles its shared-memory comm op on first use (23 min on a loaded
2-core host).
"""
import sys

import deepspeed
import torch

from moebit.models.gpt import GPT, GPTConfig

stage = int(sys.argv[1])
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, block_size=32))
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
       "zero_allow_untested_optimizer": True,
       "zero_optimization": {"stage": stage}, "fp16": {"enabled": False}, "bf16": {"enabled": False}}
deepspeed.init_distributed(dist_backend="gloo")
opt0 = torch.optim.AdamW(model.parameters(), lr=1e-3)  # a client optimizer: no DeepSpeedCPUAdam JIT build
engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt0, config=cfg)
rank = torch.distributed.get_rank()
for step in range(3):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 256, (2, 33), generator=g)
    out = engine(x[:, :-1], x[:, 1:])
    engine.backward(out.loss)
    engine.step()
    if rank == 0:
        print(f"stage {stage} step {step} loss {out.loss.item():.4f}", flush=True)
