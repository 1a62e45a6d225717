"""Shared experts (with and without Qwen2-MoE's sigmoid gate), Residual MoE, ``infer``, config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_oracles import expert_oracle  # tests/moe/moe_oracles.py

from moebit.moe import MLP, GatedMLP, MoE, MoEConfig, ResidualMoE, build_moe


def _shared_by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    se = moe.shared_expert
    if isinstance(se, GatedMLP):
        h = F.silu(x @ se.gate_proj.weight.t()) * (x @ se.up_proj.weight.t())
        y = h @ se.down_proj.weight.t()
    else:
        y = F.gelu(x @ se.fc.weight.t() + se.fc.bias) @ se.proj.weight.t() + se.proj.bias
    if moe.shared_expert_gate is not None:
        y = torch.sigmoid(x @ moe.shared_expert_gate.weight.t()) * y
    return y


@pytest.mark.parametrize("expert_type", ["gelu_mlp", "swiglu"])
@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_against_hand_oracle(expert_type: str, gate: bool) -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, d_ffn=8, num_shared_experts=2,
                    shared_expert_gate=gate, expert_type=expert_type, capacity_factor=0.75,
                    min_capacity=1)
    moe = MoE(12, cfg)
    assert moe.shared_expert is not None and (moe.shared_expert_gate is not None) == gate
    first = moe.shared_expert.gate_proj if expert_type == "swiglu" else moe.shared_expert.fc
    assert first.out_features == 16  # two shared experts of d_ffn 8, side by side
    assert not any(getattr(p, "moebit_expert", False) for p in moe.shared_expert.parameters())
    x = torch.randn(30, 12, requires_grad=True)
    proj = torch.randn(30, 12)
    out = moe(x)
    (out.hidden * proj).sum().backward()
    ours = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in moe.named_parameters()}}
    moe.zero_grad()
    x.grad = None
    want = expert_oracle(x, moe.gate(x), moe.experts) + _shared_by_hand(moe, x)
    (want * proj).sum().backward()
    assert torch.allclose(out.hidden, want, atol=1e-5)
    assert torch.allclose(ours["x"], x.grad, atol=1e-5)
    for n, p in moe.named_parameters():
        assert torch.allclose(ours[n], p.grad, atol=1e-5), n


def test_shared_expert_width_override_and_residual_types() -> None:
    cfg = MoEConfig(num_experts=4, d_ffn=8, num_shared_experts=1,
                    shared_expert_intermediate_size=20, expert_type="geglu")
    assert MoE(12, cfg).shared_expert.up_proj.out_features == 20
    layer = build_moe(12, MoEConfig(num_experts=4, d_ffn=8, residual=True, expert_type="swiglu"))
    assert isinstance(layer, ResidualMoE) and isinstance(layer.mlp, GatedMLP)
    assert layer.moe.shared_expert is None  # Residual MoE mixes its own MLP instead
    assert layer.mlp.gate_proj.out_features == 8
    plain = build_moe(12, MoEConfig(num_experts=4, d_ffn=8, residual=True, expert_bias=False))
    assert isinstance(plain.mlp, MLP) and plain.mlp.fc.bias is None


@pytest.mark.parametrize("residual", [False, True])
def test_infer_is_the_dropless_forward_without_losses(residual: bool) -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, d_ffn=8, capacity_factor=0.5,
                    eval_capacity_factor=0.5, min_capacity=1, expert_type="swiglu",
                    residual=residual, num_shared_experts=0 if residual else 1,
                    shared_expert_gate=not residual)
    layer = build_moe(12, cfg).eval()
    x = torch.randn(2, 10, 12)
    with torch.no_grad():
        got = layer.infer(x.reshape(-1, 12))
        assert layer(x).stats.fraction_dropped > 0  # forward drops, infer does not
        dropless = build_moe(12, cfg.replace(drop_tokens=False)).eval()
        dropless.load_state_dict(layer.state_dict())
        want = dropless(x).hidden.reshape(-1, 12)
    assert isinstance(got, torch.Tensor) and got.shape == (20, 12)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"expert_type": "relu_mlp"}, "expert_type"),
        ({"expert_type": "swiglu", "expert_bias": True, "num_shared_experts": 1}, "expert_bias"),
        ({"expert_type": "geglu", "swiglu_limit": 7.0}, "swiglu_limit"),
        ({"expert_type": "swiglu", "swiglu_alpha": 0}, "swiglu_alpha"),
        ({"expert_type": "swiglu", "swiglu_limit": -1.0}, "swiglu_limit"),
        ({"expert_type": "swiglu", "swiglu_up_shift": 1.0, "num_shared_experts": 1}, "swiglu"),
        ({"router_bias": "yes"}, "router_bias"),
        ({"expert_bias": "yes"}, "expert_bias"),
        ({"num_shared_experts": -1}, "num_shared_experts"),
        ({"shared_expert_gate": True}, "shared_expert_gate"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"shared_expert_intermediate_size": -1, "num_shared_experts": 1},
         "shared_expert_intermediate_size"),
        ({"residual": True, "num_shared_experts": 2}, "residual"),
        ({"kernel": "fast"}, "kernel"),
    ],
)
def test_bad_expert_block_configs_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        MoEConfig(**kwargs)


def test_expert_block_aliases() -> None:
    cfg = MoEConfig.from_dict({
        "n_shared_experts": 2, "moe_shared_expert_intermediate_size": 96,
        "moe_shared_expert_gate": True, "moe_grouped_gemm": True, "expert_type": "swiglu",
    })
    assert (cfg.num_shared_experts, cfg.shared_expert_intermediate_size) == (2, 96)
    assert cfg.shared_expert_gate and cfg.kernel == "grouped"
    assert MoEConfig.from_dict({"moe_grouped_gemm": False}).kernel == "loop"
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    assert not cfg.has_expert_bias and MoEConfig().has_expert_bias
    with pytest.raises(ValueError, match="twice"):
        MoEConfig.from_dict({"moe_grouped_gemm": True, "kernel": "loop"})
