"""Parameter counts: exact for moebit's GPT, published totals for the papers' presets,
and the Hugging Face config keys of the common MoE families."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebit.models.gpt import GPT
from moebit.plan.loaders import from_hf_config, from_train_config, load_model
from moebit.plan.presets import PRESETS, preset
from moebit.plan.spec import ModelSpec, SpecError
from moebit.training.config import build


@pytest.mark.parametrize("flags", [
    dict(n_layer=2, d_model=64, n_head=4, block_size=32),
    dict(n_layer=4, d_model=64, n_head=2, block_size=16, num_experts=4, num_experts_per_tok=2),
    dict(n_layer=4, d_model=32, n_head=2, block_size=16, num_experts=[2, 4], moe_residual=True,
         d_ffn=48),
])
def test_moebit_gpt_count_is_exact(flags: dict) -> None:
    cfg = build(None, flags)
    spec = from_train_config(cfg)
    model = GPT(cfg.model_config())
    assert spec.total_params() == model.num_params()
    assert spec.expert_total_params() == model.num_expert_params()


# Published totals (the source each preset names): BERT-Large 340M (Devlin et al. 2019);
# DeepSpeed-MoE Table 1: 350M, 1.3B, 13B, 52B, 4B, 31B; Mixtral 46.7B.
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_match_their_published_counts(name: str) -> None:
    spec = preset(name)
    assert spec.published_params is not None and spec.source
    assert spec.total_params() == pytest.approx(spec.published_params, rel=0.03)


def test_moe_active_params_count_top_k_experts() -> None:
    mixtral = preset("mixtral-8x7b")
    assert mixtral.active_params() == pytest.approx(12.9e9, rel=0.01)  # "13B active"
    dense = preset("gpt-350m")
    moe = preset("gpt-350m-moe128")
    assert moe.active_params() == pytest.approx(dense.active_params(), rel=0.01)
    assert moe.train_flops_per_token() == pytest.approx(dense.train_flops_per_token(), rel=0.01)


def test_flops_per_token_is_six_n_plus_attention() -> None:
    s = ModelSpec("t", 2, 64, 4, 256, 256, 32, learned_positions=32)
    matmul = s.total_params() - 32 * 64  # position table is a lookup; tied head multiplies
    assert s.train_flops_per_token() == 6 * matmul + 12 * 2 * 32 * 64


QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
             "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
             "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
             "tie_word_embeddings": False, "decoder_sparse_step": 1, "attention_bias": True}
OLMOE = {"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
         "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 50304,
         "tie_word_embeddings": False}


def test_hf_configs() -> None:
    # Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B active (its model card); OLMoE-1B-7B: 6.9B / 1.3B
    q = from_hf_config(QWEN2_MOE)
    assert q.total_params() == pytest.approx(14.3e9, rel=0.03)
    assert q.active_params() == pytest.approx(2.7e9, rel=0.05)
    o = from_hf_config(OLMOE)
    assert o.total_params() == pytest.approx(6.9e9, rel=0.03)
    assert o.active_params() == pytest.approx(1.3e9, rel=0.05)


def test_hf_config_missing_key_names_it(tmp_path: Path) -> None:
    raw = dict(OLMOE)
    del raw["intermediate_size"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match="intermediate_size"):
        load_model(str(p))


def test_moebit_config_file(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_text("n_layer = 2\nd_model = 64\nn_head = 4\n[moe]\nnum_experts = 4\nep_size = 2\n")
    spec, cfg = load_model(str(p))
    assert cfg is not None and cfg.moe.ep_size == 2 and spec.experts == [0, 4]
    p.write_text("n_layer = 0\n")
    with pytest.raises(SpecError, match="n_layer"):
        load_model(str(p))


@pytest.mark.parametrize("kw, field", [
    (dict(n_layer=0), "model.n_layer"),
    (dict(n_head=3), "model.n_head"),
    (dict(experts=[4]), "model.experts"),
    (dict(experts=[0, 2], top_k=4), "model.top_k"),
    (dict(ffn_matrices=4), "model.ffn_matrices"),
])
def test_bad_model_spec_names_the_field(kw: dict, field: str) -> None:
    base = dict(name="t", n_layer=2, d_model=64, n_head=4, d_ffn=256, vocab_size=256, seq_len=32)
    base.update(kw)
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        ModelSpec(**base)  # type: ignore[arg-type]


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(SpecError, match="bert-large"):
        load_model("bert-huge")
