"""TrainConfig composes a GPTConfig and its MoEConfig: every MoE knob is a flag and a key."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from moebit.cli.train import parse_train_args
from moebit.models.gpt import GPT
from moebit.moe import MoE, MoEConfig
from moebit.training.config import FLAT_KEYS, ConfigError, build, load_file


def test_every_moe_field_is_a_flag_that_reaches_the_layers():
    cfg, _ = parse_train_args([
        "--num-experts", "4", "--num-experts-per-tok", "2", "--drop-policy", "random",
        "--noise", "jitter", "--min-capacity", "7", "--eval-capacity-factor", "2.5",
        "--no-drop-tokens", "--expert-d-ffn", "48", "--n-layer", "2", "--d-model", "32",
        "--n-head", "2", "--block-size", "16",
    ])
    assert isinstance(cfg.moe, MoEConfig)
    assert (cfg.moe.drop_policy, cfg.moe.noise, cfg.moe.min_capacity) == ("random", "jitter", 7)
    assert cfg.moe.eval_capacity_factor == 2.5 and cfg.moe.drop_tokens is False
    layer = next(m for m in GPT(cfg.model).modules() if isinstance(m, MoE))
    assert layer.config.num_experts == 4 and layer.config.k == 2 and layer.config.d_ffn == 48
    assert layer.config.noise == "jitter" and layer.config.min_capacity == 7
    gated, _ = parse_train_args(["--num-experts", "4", "--expert-type", "swiglu", "--no-expert-bias",
                                 "--num-shared-experts", "1", "--shared-expert-gate"])
    assert (gated.moe.expert_type, gated.moe.expert_bias) == ("swiglu", False)
    assert gated.moe.num_shared_experts == 1 and gated.moe.shared_expert_gate is True
    moe_keys = {f.name for f in fields(MoEConfig)} - {"num_experts", "residual", "d_ffn"}
    assert moe_keys <= set(FLAT_KEYS)


def test_flat_round_trip_and_old_config_files(tmp_path: Path):
    cfg = build({"num_experts": [2, 4], "n_layer": 4, "ep_size": 2, "capacity_factor": 1.5,
                 "moe_residual": True})
    again = build(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.to_dict() == cfg.to_dict()
    # A config.json written before the MoE settings composed: the same flat keys.
    old = {"n_layer": 4, "num_experts": 4, "moe_every": 2, "num_experts_per_tok": 1,
           "moe_residual": False, "capacity_factor": 1.0, "eval_capacity_factor": 1.0,
           "drop_tokens": True, "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.0,
           "ep_size": 2, "d_ffn": 0, "steps": 10}
    assert build(old).moe.ep_size == 2 and build(old).model.num_experts == 4


def test_tables_group_keys(tmp_path: Path):
    f = tmp_path / "run.toml"
    f.write_text('[model]\nn_layer = 2\nnum_experts = 4\n[moe]\nnoise = "rsample"\n'
                 'num_experts_per_tok = 2\n[train]\nsteps = 7\n')
    cfg = build(load_file(str(f)))
    assert cfg.model.n_layer == 2 and cfg.moe.noise == "rsample" and cfg.moe.k == 2
    assert cfg.steps == 7


def test_errors_name_the_key():
    with pytest.raises(ConfigError, match="drop_policy"):
        build({"num_experts": 4, "drop_policy": "sometimes"})
    with pytest.raises(ConfigError, match="ep_size"):
        build({"num_experts": 3, "ep_size": 2})
    with pytest.raises(ConfigError, match="unknown setting 'capacity'"):
        build({"capacity": 2})
    with pytest.raises(ConfigError, match="lr: expected a finite number"):
        build({"lr": "inf"})
    with pytest.raises(ConfigError, match="optimizer"):
        build({"optimizer": "sgd"})


def test_dense_model_has_no_moe_settings():
    assert build({}).moe is None and build({}).model.moe is None
