"""Run by torchrun (2 gloo ranks): 1-bit Adam under a DDP-wrapped HF decoder through
``onebit_optimizer_for_ddp``, beside the same run with moebit's own exchange; rank 0
writes both loss curves as JSON to argv[1]."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from moebit.hf import HFDecoder, HFDecoderConfig
from moebit.hf.ddp import onebit_optimizer_for_ddp
from moebit.optim import build_optimizer
from moebit.runs.runtime import finish

TINY = {"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}


def main(out: str, name: str = "onebit_adam") -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = HFDecoder(HFDecoderConfig.from_hf(TINY)).train()
    ddp = DistributedDataParallel(copy.deepcopy(plain))
    kw = {"lr": 3e-3, "freeze_step": 3}
    opts = {"moebit": build_optimizer(name, [{"params": list(plain.parameters())}], **kw),
            "ddp": onebit_optimizer_for_ddp(ddp, name, **kw)}
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(100 + rank))
    losses: dict[str, list[float]] = {"moebit": [], "ddp": []}
    for _ in range(10):
        for k, m in (("moebit", plain), ("ddp", ddp)):
            o = m(ids[:, :-1], ids[:, 1:])
            (o.loss + o.aux_loss).backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            losses[k].append(float(o.loss.detach()))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"frozen_at": getattr(opts["ddp"], "frozen_at", None),
                       "ranks": gathered}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # leave as moebit's own ranks do: gloo's threads can outlive the destroyed group, and a
    # normal interpreter exit then aborts now and then ("terminate called without an
    # active exception"; moebit.runs.runtime.finish)
    finish(0)
