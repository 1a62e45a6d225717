"""MoE and ResidualMoE: the feed-forward contract (.hidden, .aux_loss) and the mixing."""

from __future__ import annotations

import pytest
import torch

from moebit.moe import MLP, MoE, MoEConfig, ResidualMoE, build_moe, is_expert_param, split_params_for_ep


def test_moe_output_contract_and_loss_weights() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1,
                    router_z_loss_coef=0.01, d_ffn=32)
    moe = MoE(16, cfg)
    x = torch.randn(2, 12, 16)
    out = moe(x)
    assert out.hidden.shape == x.shape
    assert out.aux_loss.dim() == 0
    want = 0.1 * out.balance_loss + 0.01 * out.z_loss
    assert torch.allclose(out.aux_loss, want)
    flat = moe(x.reshape(-1, 16))
    assert torch.allclose(flat.hidden.view_as(x), out.hidden)
    assert out.stats.tokens_per_expert.sum() == 2 * 24


def test_residual_moe_mixes_dense_and_moe_per_token() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=1, residual=True, d_ffn=32)
    layer = build_moe(16, cfg)
    assert isinstance(layer, ResidualMoE) and isinstance(layer.mlp, MLP)
    x = torch.randn(3, 5, 16, requires_grad=True)
    out = layer(x)
    c = torch.softmax(layer.coef(x), -1)
    want = c[..., :1] * layer.moe(x).hidden + c[..., 1:] * layer.mlp(x)
    assert torch.allclose(out.hidden, want, atol=1e-6)
    assert out.aux_loss.dim() == 0
    (out.hidden.sum() + out.aux_loss).backward()
    assert layer.coef.weight.grad.abs().sum() > 0 and layer.mlp.fc.weight.grad is not None
    assert isinstance(build_moe(16, cfg.replace(residual=False)), MoE)


def test_expert_params_are_marked_and_split() -> None:
    layer = ResidualMoE(16, MoEConfig(num_experts=4, d_ffn=8))
    names = {n for n, p in layer.named_parameters() if is_expert_param(p)}
    assert names == {"moe.experts.w1", "moe.experts.b1", "moe.experts.w2", "moe.experts.b2"}
    assert layer.moe.experts.w1.shape == (4, 16, 8)
    assert layer.moe.experts.w2.shape == (4, 8, 16)
    groups = split_params_for_ep(layer)
    assert [g["moebit_group"] for g in groups] == ["dense", "expert"]
    assert all(g["process_group"] is None for g in groups)  # single process: the world
    assert sum(len(g["params"]) for g in groups) == len(list(layer.parameters()))
    opt = torch.optim.AdamW(groups, lr=1e-3)  # plain optimizers accept the extra keys
    assert len(opt.param_groups) == 2


def test_eval_uses_eval_capacity_factor() -> None:
    torch.manual_seed(0)
    moe = MoE(16, MoEConfig(num_experts=4, capacity_factor=0.5, eval_capacity_factor=4.0,
                            min_capacity=1))
    x = torch.randn(64, 16)
    assert moe(x).stats.capacity == 8
    moe.eval()
    with torch.no_grad():
        out = moe(x)
    assert out.stats.capacity == 64 and out.stats.fraction_dropped == 0


@pytest.mark.parametrize("k", [1, 4])
def test_every_k_up_to_num_experts(k: int) -> None:
    moe = MoE(8, MoEConfig(num_experts=4, num_experts_per_tok=k, drop_tokens=False))
    out = moe(torch.randn(10, 8))
    assert out.stats.tokens_per_expert.sum() == 10 * k
