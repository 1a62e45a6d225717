"""Tiny GPTs and batches for the sharded-training tests (run inside gloo ranks).

Every rank builds its model from the same seed (a real run's init), then draws its own
batches (seeded by rank and step), so a gradient that is not averaged, or averaged over
the wrong group, leaves the ranks apart.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from moebit.models.gpt import GPT, GPTConfig
from moebit.models.hf import HFDecoder, HFDecoderConfig
from moebit.moe import allreduce_grads_, split_params_for_ep

# FSDP2 warns that blocks return views (GPT's blocks return tuples of fresh tensors)
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

BLOCK = 16


def tiny_gpt(ep: int = 0, seed: int = 0, d_model: int = 16) -> GPT:
    """A 2-block GPT; ep > 0 makes block 2 an MoE block of 4 experts over ``ep`` ranks."""
    torch.manual_seed(seed)
    moe = {}
    if ep:
        moe = {"num_experts": 4, "moe": {"num_experts_per_tok": 2, "ep_size": ep,
                                          "capacity_factor": 4.0, "kernel": "loop"}}
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=d_model, block_size=BLOCK, **moe))


HF_QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32,
                "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "decoder_sparse_step": 1, "norm_topk_prob": True,
                "max_position_embeddings": 64}


def tiny_hf(ep: int = 1, seed: int = 0) -> HFDecoder:
    """moebit's decoder of a tiny Qwen3-MoE config (4 experts, every layer MoE)."""
    torch.manual_seed(seed)
    return HFDecoder(HFDecoderConfig.from_hf(HF_QWEN3_MOE, ep_size=ep))


def batch(rank: int, step: int, rows: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 96, (rows, BLOCK), generator=g)  # ids every toy model knows


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x[:, :-1], x[:, 1:])
    return out.loss + out.aux_loss


def replicated_step(model: GPT, x: torch.Tensor) -> float:
    """Backward on this rank's batch, then gradients averaged as the replicated path does
    (dense over the world, experts over their expert-data-parallel group)."""
    loss = loss_of(model, x)
    loss.backward()
    allreduce_grads_(split_params_for_ep(model))
    return world_mean(loss.detach())


def world_mean(t: torch.Tensor) -> float:
    t = t.clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def local(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (gathered over its mesh); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
