"""Expert-parallel and data-parallel generation on real gloo ranks, under a hard timeout.

Each rank builds the same model, then keeps only its slice of every MoE layer's experts
(the single-process model's weights, so the comparison does not rest on init details).
"""

from __future__ import annotations

import torch

from moebit.inference.generate import generate, generate_tokens
from moebit.models.gpt import GPT, GPTConfig
from moebit.testing import run_on_ranks

TIMEOUT = 60
PROMPTS = ["def foo(", "x", "", "import os\nimport sys\n" * 2, "class A:\n    "]


def _model(ep_size: int, num_experts: int | list[int] = 8, residual: bool = False) -> GPT:
    from test_inference_decode import sharpen_

    torch.manual_seed(0)
    moe = {"num_experts_per_tok": 2, "residual": residual}
    full = GPT(GPTConfig(n_layer=4, n_head=2, d_model=32, block_size=48,
                         num_experts=num_experts, moe=moe))
    sharpen_(full)
    if ep_size == 1:
        return full
    model = GPT(GPTConfig(n_layer=4, n_head=2, d_model=32, block_size=48, num_experts=num_experts,
                          moe={**moe, "ep_size": ep_size}))
    r = torch.distributed.get_rank() % ep_size
    state = {}
    for name, t in full.state_dict().items():
        if name.split(".")[-1] in ("w1", "b1", "w2", "b2") and ".experts." in name:
            n = t.shape[0] // ep_size
            t = t[r * n:(r + 1) * n]
        state[name] = t
    model.load_state_dict(state)
    return model


def _ep_body(rank: int, world: int, kind: str) -> dict[str, object]:
    torch.set_num_threads(1)
    m = _model(world, [4, 8] if kind == "pr-moe" else 8, residual=kind == "pr-moe")
    greedy = generate_tokens(m, [list(p.encode()) for p in PROMPTS], max_new_tokens=20,
                             temperature=0, batch_size=2)
    sampled = generate(m, PROMPTS, max_new_tokens=20, temperature=0.9, top_k=30, seed=5, batch_size=2)
    return {"greedy": greedy.tokens, "sampled": sampled, "steps": greedy.global_steps,
            "busy": greedy.decode_steps}


def test_expert_parallel_two_ranks_equals_one_process() -> None:
    torch.set_num_threads(1)
    for kind in ("moe", "pr-moe"):
        m = _model(1, [4, 8] if kind == "pr-moe" else 8, residual=kind == "pr-moe")
        want_greedy = generate_tokens(m, [list(p.encode()) for p in PROMPTS], max_new_tokens=20,
                                      temperature=0).tokens
        want_sampled = generate(m, PROMPTS, max_new_tokens=20, temperature=0.9, top_k=30, seed=5)
        r0, r1 = run_on_ranks(_ep_body, world=2, args=(kind,), timeout=TIMEOUT)
        for r in (r0, r1):  # every rank returns every prompt's text
            assert r["greedy"] == want_greedy, kind
            assert r["sampled"] == want_sampled, kind
        # rank 0 decodes 3 prompts in 2 mini-batches, rank 1 two in one: rank 1 served
        # rank 0's experts while idle, in lockstep
        assert r0["steps"] == r1["steps"]
        assert r1["busy"] < r0["busy"]


def _uneven_body(rank: int, world: int) -> dict[str, object]:
    torch.set_num_threads(1)
    m = _model(world)
    # each rank serves its own requests (shard=False): rank 0 one prompt with a 40-token
    # budget, rank 1 a prompt that leaves room for 3 tokens; then rank 1 has no request
    mine = [[[5, 6]], [[9] * 45]][rank]
    res = generate_tokens(m, mine, max_new_tokens=40, temperature=0, shard=False)
    alone = generate_tokens(m, [[[5, 6]], []][rank], max_new_tokens=10, temperature=0, shard=False)
    return {"tokens": res.tokens, "steps": res.global_steps, "alone": alone.tokens,
            "alone_steps": alone.global_steps}


def test_ranks_finishing_at_different_steps_do_not_hang() -> None:
    torch.set_num_threads(1)
    r0, r1 = run_on_ranks(_uneven_body, world=2, timeout=TIMEOUT)
    m = _model(1)
    want = generate_tokens(m, [[5, 6], [9] * 45], max_new_tokens=40, temperature=0).tokens
    assert r0["tokens"] == [want[0]] and len(want[0]) == 40
    assert r1["tokens"] == [want[1]] and len(want[1]) == 3
    assert r0["steps"] == r1["steps"] == 40  # rank 1 kept serving for 37 steps after finishing
    assert r0["alone"] == [want[0][:10]] and r1["alone"] == []
    assert r0["alone_steps"] == r1["alone_steps"] == 10


def _dp_dense_body(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    from test_inference_decode import sharp_model

    m = sharp_model("dense")
    return generate(m, PROMPTS, max_new_tokens=10, temperature=0.7, seed=1, batch_size=2)


def test_data_parallel_dense_gathers_every_prompt() -> None:
    torch.set_num_threads(1)
    from test_inference_decode import sharp_model

    want = generate(sharp_model("dense"), PROMPTS, max_new_tokens=10, temperature=0.7, seed=1)
    r0, r1 = run_on_ranks(_dp_dense_body, world=2, timeout=TIMEOUT)
    assert r0 == r1 == want
