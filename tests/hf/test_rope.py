"""RoPE scaling variants against transformers, on sequences past the original context."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import make_hf_model

from moebit.hf import from_pretrained, save_pretrained
from moebit.inference.generate import generate_tokens
from moebit.models.hf.config import HFDecoderConfig
from moebit.models.rope import parse_rope, rope_frequencies

transformers = pytest.importorskip("transformers")

ORIG = 32  # the original context of every case: the tests run past it
LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": ORIG,
            "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.0, 1.9, 3.7, 7.5]}
CASES = {
    "qwen3_moe-yarn": ("qwen3_moe", 128, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                          "original_max_position_embeddings": ORIG}),
    "qwen3_moe-yarn-mscale": ("qwen3_moe", 128, {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": ORIG,
        "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5}),
    "qwen2_moe-yarn-attention-factor": ("qwen2_moe", 128, {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 1.3,
        "original_max_position_embeddings": ORIG}),
    # head_dim 16, theta 1e4: wavelengths 6.3 (kept), 19.9 (blended), 63 and up (divided)
    "mixtral-llama3": ("mixtral", 128, {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": ORIG}),
    # dynamic NTK rescales past max_position_embeddings itself
    "qwen2_moe-dynamic": ("qwen2_moe", ORIG, {"rope_type": "dynamic", "rope_theta": 1e4,
                                              "factor": 2.0}),
    "olmoe-linear": ("olmoe", ORIG, {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
    "qwen3_moe-longrope": ("qwen3_moe", 128, LONGROPE),
}
HEAD_DIM = {"mixtral": 16, "qwen3_moe": 8}


def _make(case: str, folder, seed: int = 0):
    family, max_pos, rope = CASES[case]
    extra = {"head_dim": HEAD_DIM[family]} if family in HEAD_DIM else {}
    return make_hf_model(family, folder, seed=seed, num_hidden_layers=2,
                         max_position_embeddings=max_pos, rope_parameters=dict(rope), **extra)


def _ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


def _to_4x_spelling(folder) -> dict:
    """Rewrite config.json as transformers 4.x wrote it: top-level rope_theta, rope_scaling
    with the legacy "type" key."""
    path = folder / "config.json"
    hf = json.loads(path.read_text())
    rope = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    hf["rope_scaling"] = rope
    path.write_text(json.dumps(hf))
    return hf


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_past_the_original_context(case, tmp_path):
    ref = _make(case, tmp_path)
    model = from_pretrained(tmp_path)
    assert model.config.rope_type == CASES[case][2]["rope_type"]
    # long, then short (longrope's short factors, dynamic's reset), then long again
    with torch.no_grad():
        for t in (ORIG + 16, ORIG - 12, ORIG + 8):
            ids = _ids(2, t, seed=t)
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=0,
                                       msg=lambda m, t=t: f"T={t}: {m}")


def test_dynamic_keeps_transformers_state_across_calls(tmp_path):
    """transformers' dynamic NTK only grows its frequencies until a forward shorter than
    max_position_embeddings resets them: a 40-token forward after a 48-token one uses the
    48-token frequencies, and so does one of exactly max_position_embeddings tokens."""
    ref = _make("qwen2_moe-dynamic", tmp_path)
    model = from_pretrained(tmp_path)
    with torch.no_grad():
        for t in (48, 40, ORIG, 20, 40, 36):
            ids = _ids(1, t, seed=t)
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=0,
                                       msg=lambda m, t=t: f"T={t}: {m}")
            assert model.rotary_emb.max_seq_len_cached == ref.model.rotary_emb.max_seq_len_cached


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_past_the_original_context(case, tmp_path):
    """Prompts of 20 tokens, 24 new ones: the cache crosses the original context (for
    dynamic NTK, every step past it rescales the new token's rotation only)."""
    ref = _make(case, tmp_path)
    model = from_pretrained(tmp_path)
    model.config.block_size = 64  # dynamic: decode past max_position_embeddings
    ids = _ids(2, 20, seed=3)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=24, min_new_tokens=24)
    got = generate_tokens(model, ids.tolist(), max_new_tokens=24, temperature=0).tokens
    assert got == want[:, 20:].tolist()


def test_greedy_generation_left_padded_dynamic(tmp_path):
    """Prompts of different lengths: the longest row's position decides the frequencies."""
    ref = _make("qwen2_moe-dynamic", tmp_path)
    model = from_pretrained(tmp_path)
    model.config.block_size = 64
    ids = _ids(2, 22, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    padded = ids.masked_fill(mask == 0, 0)
    want = ref.generate(padded, attention_mask=mask, do_sample=False, pad_token_id=0,
                        max_new_tokens=20, min_new_tokens=20)
    got = generate_tokens(model, [ids[0].tolist(), ids[1, 9:].tolist()], max_new_tokens=20,
                          temperature=0).tokens
    assert got == want[:, 22:].tolist()


@pytest.mark.parametrize("case", ["qwen3_moe-yarn-mscale", "mixtral-llama3", "qwen2_moe-dynamic"])
def test_4x_rope_scaling_spelling_loads_and_saves_back_unchanged(case, tmp_path):
    _make(case, tmp_path / "src")
    hf = _to_4x_spelling(tmp_path / "src")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    model = from_pretrained(tmp_path / "src")
    ids = _ids(2, ORIG + 16)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)
    save_pretrained(model, tmp_path / "out")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["rope_scaling"] == hf["rope_scaling"] and out["rope_theta"] == hf["rope_theta"]
    assert "rope_parameters" not in out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["qwen3_moe-yarn", "qwen3_moe-longrope", "olmoe-linear"])
def test_save_pretrained_writes_rope_parameters_back(case, tmp_path):
    _make(case, tmp_path / "src")
    src = json.loads((tmp_path / "src" / "config.json").read_text())
    model = from_pretrained(tmp_path / "src")
    save_pretrained(model, tmp_path / "out")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["rope_parameters"] == src["rope_parameters"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = _ids(1, ORIG + 16)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
    # the manifest form (HFDecoderConfig.to_dict) rebuilds the same frequencies
    again = HFDecoderConfig.from_dict(json.loads(json.dumps(model.config.to_dict())))
    assert again.rope == model.config.rope


def test_frequencies_stay_float32_in_bfloat16(tmp_path):
    ref = _make("qwen3_moe-yarn", tmp_path)
    model = from_pretrained(tmp_path, dtype=torch.bfloat16)
    rot = model.rotary_emb
    assert rot.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rot.inv_freq, ref.model.rotary_emb.inv_freq, atol=0, rtol=0)
    assert rot.attention_scaling == ref.model.rotary_emb.attention_scaling


def test_old_manifest_without_rope_params_loads():
    """Manifests written before rope_params existed rebuild as the default/linear RoPE."""
    hf = {"model_type": "mixtral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_local_experts": 2,
          "num_experts_per_tok": 1, "rope_theta": 1e4}
    d = HFDecoderConfig.from_hf(hf).to_dict()
    del d["rope_params"]
    assert HFDecoderConfig.from_dict(d).rope.rope_type == "default"
    assert HFDecoderConfig.from_hf({k: v for k, v in hf.items() if k != "rope_theta"}).rope_theta == 1e6


_BASE = {"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
         "moe_intermediate_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2,
         "head_dim": 8, "num_experts": 2, "num_experts_per_tok": 1, "max_position_embeddings": 64}


@pytest.mark.parametrize(("key", "rope", "named"), [
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "foo": 1}, r"unknown key 'foo'"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "beta_fast": 8}, "'beta_fast'"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
     "needs 'low_freq_factor'"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                         "high_freq_factor": 1.0}, r"rope_parameters\.high_freq_factor"),
    ("rope_parameters", {"rope_type": "yarn", "factor": "big"}, r"rope_parameters\.factor"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 0.5}, r"rope_parameters\.factor.*>= 1"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "truncate": "yes"}, r"\.truncate"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "beta_fast": 1, "beta_slow": 8},
     r"\.beta_fast"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0,
                         "original_max_position_embeddings": 8.5},
     r"\.original_max_position_embeddings"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "attention_factor": -1.0},
     r"\.attention_factor"),
    ("rope_parameters", {**LONGROPE, "short_factor": [1.0, 1.0]}, r"\.short_factor.*4 numbers"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": -5}, r"\.rope_theta"),
    ("rope_parameters", {"rope_type": "mrope"}, "'mrope' is not supported"),
    ("rope_scaling", {"type": "dynamic"}, r"rope_scaling: rope_type 'dynamic' needs 'factor'"),
    ("rope_scaling", {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0},
     r"rope_scaling: unknown key 'low_freq_factor'"),
    ("rope_scaling", [2.0], "rope_scaling must be a JSON object"),
])
def test_bad_rope_parameters_are_named(key, rope, named):
    with pytest.raises(ValueError, match=named):
        HFDecoderConfig.from_hf({**_BASE, key: rope})


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    hf = {**_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
          "rope_scaling": {"type": "linear", "factor": 4.0}}
    spec = parse_rope(hf, head_dim=8)
    # rope_parameters is not read at all, its theta neither: the top-level one or the default
    assert (spec.rope_type, spec.factor, spec.theta) == ("linear", 4.0, 1e4)
    cfg = transformers.AutoConfig.for_model(**hf)
    assert cfg.rope_parameters["rope_type"] == "linear"
    assert cfg.rope_parameters["rope_theta"] == spec.theta
    inv, _ = rope_frequencies(spec)
    torch.testing.assert_close(inv, transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[
        "linear"](cfg)[0], atol=0, rtol=0)
