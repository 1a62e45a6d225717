"""MoEConfig: names, DeepSpeed aliases, and clear errors for impossible configs."""

from __future__ import annotations

import pytest
import torch

from moebit.moe import MoE, MoEConfig


def test_deepspeed_aliases_map_to_our_fields() -> None:
    cfg = MoEConfig.from_dict({
        "k": 2, "num_experts": 8, "use_residual": True, "use_rts": True,
        "noisy_gate_policy": "Jitter", "min_capacity": 4, "ep_size": 2,
        "capacity_factor": 1.25, "eval_capacity_factor": 2.0, "drop_tokens": False,
    })
    assert cfg.num_experts_per_tok == 2 and cfg.k == 2
    assert cfg.residual is True
    assert cfg.drop_policy == "random"
    assert cfg.noise == "jitter"
    assert cfg.ep_size == 2 and cfg.num_local_experts == 4
    assert cfg.capacity_factor == 1.25 and cfg.eval_capacity_factor == 2.0
    assert cfg.drop_tokens is False
    assert MoEConfig.from_dict({"noisy_gate_policy": "RSample"}).noise == "rsample"
    assert MoEConfig.from_dict({"noisy_gate_policy": None, "use_rts": False}).noise == "none"
    assert MoEConfig.from_dict({"num_local_experts": 4, "top_k": 3}).k == 3


def test_hugging_face_names_round_trip() -> None:
    cfg = MoEConfig(num_experts=16, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_key_is_named() -> None:
    with pytest.raises(ValueError, match="'num_expert'"):
        MoEConfig.from_dict({"num_expert": 8})


def test_same_field_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="twice"):
        MoEConfig.from_dict({"k": 2, "num_experts_per_tok": 2})


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts": 6, "ep_size": 4}, "ep_size"),
        ({"num_experts": 0}, "num_experts"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"eval_capacity_factor": -1.0}, "eval_capacity_factor"),
        ({"drop_policy": "last"}, "drop_policy"),
        ({"noise": "gaussian"}, "noise"),
        ({"min_capacity": -1}, "min_capacity"),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef"),
        ({"d_ffn": 0}, "d_ffn"),
    ],
)
def test_bad_configs_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        MoEConfig(**kwargs)


def test_bad_deepspeed_noise_policy() -> None:
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoEConfig.from_dict({"noisy_gate_policy": "Gaussian"})


def test_ep_without_groups_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="expert_parallel_groups"):
        MoE(16, MoEConfig(num_experts=4, ep_size=2))


def test_wrong_input_width_is_a_clear_error() -> None:
    moe = MoE(16, MoEConfig(num_experts=4))
    with pytest.raises(ValueError, match=r"\[B, T, 16\]"):
        moe(torch.randn(3, 8))
