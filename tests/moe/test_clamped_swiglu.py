"""gpt-oss's expert block in moebit.moe: biased gate_up/down projections, the clamped SwiGLU
(alpha, limit, the up + 1 form) and a biased router, on every kernel and the int8 experts,
against the per-expert oracle (moe_oracles.py: transformers' formula written out)."""

from __future__ import annotations

import pytest
import torch
from moe_oracles import expert_oracle

from moebit.inference.quantize import QuantExperts
from moebit.moe import MoE, MoEConfig
from moebit.moe.glu import ClampedSwiGLU

KERNELS = ["loop", "padded", "grouped", "threaded"]


def _gpt_oss_moe(kernel: str, limit: float = 0.4) -> MoE:
    """A small limit, so that both clamps cut real values (gpt-oss's own is 7)."""
    cfg = MoEConfig(num_experts=6, num_experts_per_tok=4, drop_tokens=False, d_ffn=10,
                    expert_type="swiglu", expert_bias=True, swiglu_alpha=1.702,
                    swiglu_limit=limit, swiglu_up_shift=1.0, router_bias=True,
                    softmax_before_topk=False, router_aux_loss_coef=0.0, kernel=kernel)
    torch.manual_seed(0)
    moe = MoE(12, cfg)
    with torch.no_grad():
        moe.gate.router.bias.normal_(0, 1.0)
    return moe


@pytest.mark.parametrize("kernel", KERNELS)
def test_clamped_swiglu_with_biases_matches_the_oracle(kernel: str) -> None:
    moe = _gpt_oss_moe(kernel)
    assert moe.experts.act == ClampedSwiGLU(1.702, 0.4, 1.0)
    x = torch.randn(3, 9, 12, requires_grad=True)
    proj = torch.randn(3, 9, 12)
    out = moe(x)
    (out.hidden * proj).sum().backward()
    ours = out.hidden.detach()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    gx = x.grad.clone()
    assert set(grads) >= {"gate.router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias"}
    moe.zero_grad()
    x.grad = None
    routing = moe.gate(x.reshape(-1, 12))
    pre = torch.nn.functional.linear(x.reshape(-1, 12), moe.gate.router.weight, moe.gate.router.bias)
    top = pre.topk(4, dim=-1)  # transformers' router: top-4 of the biased logits, softmax over them
    assert torch.equal(routing.expert_SK, top.indices)
    torch.testing.assert_close(routing.weight_SK, torch.softmax(top.values, -1))
    ref = expert_oracle(x.reshape(-1, 12), routing, moe.experts).view_as(x)
    (ref * proj).sum().backward()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=1e-4)
    for name, p in moe.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    hpre = torch.einsum("sd,efd->sef", x.detach().reshape(-1, 12), moe.experts.gate_up_proj)
    assert (hpre[..., :10] > 0.4).any() and (hpre[..., 10:].abs() > 0.4).any()  # clamps cut


def test_int8_experts_run_the_clamped_swiglu() -> None:
    moe = _gpt_oss_moe("loop").eval()
    x = torch.randn(20, 12)
    with torch.no_grad():
        want = moe.infer(x)
        q = QuantExperts(moe.experts, kernel="dequant")
        assert q.act == moe.experts.act and q.b_up is not None
        moe.experts = q
        got = moe.infer(x)
        plain = _gpt_oss_moe("loop", limit=None).eval()  # the same weights, no clamp
        assert (plain.infer(x) - want).abs().max() > 1e-2
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
