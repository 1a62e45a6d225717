"""The new expert types (and shared experts) expert-parallel on gloo ranks: ep 2, ep 2 x dp 2.

As in test_moe_parallel.py: each rank routes its own tokens; the one-process reference
runs the same layer (same seed, all E experts) on every rank's tokens in turn, and after
``allreduce_grads_(split_params_for_ep(moe))`` every rank's gradients equal the
reference's gradients of the mean loss, expert slices included, for every kernel.
"""

from __future__ import annotations

import torch

from moebit.moe import MoE, MoEConfig, allreduce_grads_, expert_parallel_groups, split_params_for_ep
from moebit.testing import run_on_ranks

TIMEOUT = 120
D = 16


def _check(rank: int, world: int, groups, cfg: MoEConfig) -> None:
    torch.manual_seed(0)
    moe = MoE(D, cfg, groups)
    torch.manual_seed(0)
    ref = MoE(D, cfg.replace(ep_size=1))
    g = torch.Generator().manual_seed(1234)
    xs = [torch.randn(40, D, generator=g) for _ in range(world)]
    projs = [torch.randn(40, D, generator=g) for _ in range(world)]

    x = xs[rank].clone().requires_grad_(True)
    out = moe(x)
    ((out.hidden * projs[rank]).sum() + out.aux_loss).backward()
    allreduce_grads_(split_params_for_ep(moe))
    with torch.no_grad():
        assert torch.allclose(moe.eval().infer(xs[rank]), ref.eval().infer(xs[rank]), atol=1e-5)
    moe.train()
    ref.train()

    total = 0.0
    for r in range(world):
        xr = xs[r].clone().requires_grad_(True)
        o = ref(xr)
        total = total + (o.hidden * projs[r]).sum() + o.aux_loss
        if r == rank:
            assert torch.allclose(out.hidden, o.hidden, atol=1e-5), "outputs differ"
            ref_x = xr
    (total / world).backward()
    assert torch.allclose(x.grad, ref_x.grad * world, atol=1e-5), "input gradients differ"
    n_local = cfg.num_experts // cfg.ep_size
    lo = groups.ep_ranks.index(rank) * n_local
    full = dict(ref.named_parameters())
    for name, p in moe.named_parameters():
        want = full[name].grad
        if getattr(p, "moebit_expert", False):
            assert torch.equal(p.data, full[name].data[lo:lo + n_local]), f"{name} init differs"
            want = want[lo:lo + n_local]
        assert torch.allclose(p.grad, want, atol=1e-5), f"{name} ({cfg.expert_type}, {cfg.kernel})"


def _body(rank: int, world: int) -> int:
    groups = expert_parallel_groups(2)
    checked = 0
    for expert_type, kernel in (("swiglu", "loop"), ("swiglu", "grouped"), ("geglu", "padded"),
                                ("gelu_mlp", "grouped")):
        for k, drop in ((2, True), (3, False)):
            cfg = MoEConfig(num_experts=4, num_experts_per_tok=k, ep_size=2, d_ffn=20,
                            capacity_factor=0.75, min_capacity=1, drop_tokens=drop,
                            expert_type=expert_type, expert_bias=False if expert_type == "gelu_mlp"
                            else None, kernel=kernel, num_shared_experts=1,
                            shared_expert_gate=drop)
            _check(rank, world, groups, cfg)
            checked += 1
    return checked


def test_new_expert_types_ep2_on_two_ranks() -> None:
    assert run_on_ranks(_body, world=2, timeout=TIMEOUT) == [8, 8]


def test_new_expert_types_ep2_dp2_on_four_ranks() -> None:
    assert run_on_ranks(_body, world=4, timeout=TIMEOUT) == [8, 8, 8, 8]
