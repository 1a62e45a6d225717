"""Greedy generation on CUDA gives the CPU's text, dense and MoE, with and without the cache."""

from __future__ import annotations

import copy

import pytest
import torch

from moebit.inference.generate import generate, generate_tokens
from moebit.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.cuda

PROMPTS = ["def ", "import os\n", "class A:\n    "]


def _model(moe: bool) -> GPT:
    torch.manual_seed(0)
    extra = {"num_experts": 4, "moe": {"num_experts_per_tok": 2}} if moe else {}
    return GPT(GPTConfig(block_size=96, n_layer=2, n_head=2, d_model=64, **extra)).eval()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_generation_on_cuda_equals_cpu(moe: bool):
    model = _model(moe)
    ids = [list(p.encode()) for p in PROMPTS]
    cpu = copy.deepcopy(model)
    want = generate_tokens(cpu, ids, max_new_tokens=40, temperature=0.0).tokens
    gpu = model.cuda()
    assert generate_tokens(gpu, ids, max_new_tokens=40, temperature=0.0).tokens == want
    # without the KV cache (the whole sequence each step, through the model's forward)
    text = generate(cpu, PROMPTS[:1], max_new_tokens=40, temperature=0.0, use_cache=False)
    assert generate(gpu, PROMPTS[:1], max_new_tokens=40, temperature=0.0, use_cache=False) == text
