"""moebit's HFDecoder against transformers on the same random checkpoints (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import forward_both, make_hf_model, token_ids

from moebit.hf import build_empty, from_pretrained, load_hf_weights, read_config, save_pretrained
from moebit.inference.generate import generate_tokens
from moebit.models.hf.config import HFDecoderConfig

transformers = pytest.importorskip("transformers")


def test_logits_router_logits_and_aux_loss_match(family, tmp_path):
    ref = make_hf_model(family, tmp_path)
    model = from_pretrained(tmp_path)
    ids = token_ids()
    r, o, full = forward_both(ref, model, ids)
    coef = ref.config.router_aux_loss_coef
    torch.testing.assert_close(full.aux_loss, coef * r.aux_loss.float(), atol=1e-6, rtol=1e-5)
    # transformers' loss = CE(shifted) + coef * aux: moebit's loss on shifted targets + aux
    torch.testing.assert_close(o.loss + full.aux_loss, r.loss, atol=1e-4, rtol=0)


def test_greedy_generation_matches(family, tmp_path):
    ref = make_hf_model(family, tmp_path)
    model = from_pretrained(tmp_path)
    ids = token_ids(2, 7, seed=3)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=10, min_new_tokens=10)
    got = generate_tokens(model, ids.tolist(), max_new_tokens=10, temperature=0).tokens
    assert got == want[:, 7:].tolist()


def test_save_pretrained_loads_in_transformers(family, tmp_path):
    make_hf_model(family, tmp_path / "src")
    model = from_pretrained(tmp_path / "src")
    with torch.no_grad():  # move off the source weights so a silent no-op save would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained(model, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # dense shard + one expert shard
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
    again = from_pretrained(tmp_path / "out")  # and moebit reads its own output back
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_fused_5x_layout_loads(tmp_path):
    """A checkpoint holding transformers 5.x's fused expert tensors (its state_dict names)."""
    from safetensors.torch import save_file

    ref = make_hf_model("qwen3_moe", tmp_path)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    (tmp_path / "model.safetensors").unlink()
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = from_pretrained(tmp_path)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)


def test_missing_tensor_and_bad_shape_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model("mixtral", tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    del sd[name]
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = build_empty(read_config(tmp_path))
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        load_hf_weights(m, tmp_path)
    sd[name] = torch.zeros(3, 3)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}.*\(3, 3\)"):
        load_hf_weights(m, tmp_path)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("model_type", "llama4", "llama4"),
    ("hidden_act", "gelu", "hidden_act"),
    ("sliding_window", 64, "sliding_window"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "yarn"),
])
def test_unsupported_config_is_named(key, value, named):
    hf = {"model_type": "mixtral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_local_experts": 2,
          "num_experts_per_tok": 1, key: value}
    with pytest.raises(ValueError, match=named):
        HFDecoderConfig.from_hf(hf)


def test_layer_patterns():
    base = {"model_type": "qwen2_moe", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "moe_intermediate_size": 4, "shared_expert_intermediate_size": 4,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_experts": 2,
            "num_experts_per_tok": 1}
    assert HFDecoderConfig.from_hf(base).moe_layers == [0, 1, 2, 3, 4, 5]
    step = HFDecoderConfig.from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert step.moe_layers == [1, 5]
    assert HFDecoderConfig.from_hf({**base, "first_k_dense_replace": 2}).moe_layers == [2, 3, 4, 5]


def test_tied_embeddings(tmp_path):
    ref = make_hf_model("qwen3_moe", tmp_path, tie_word_embeddings=True)
    model = from_pretrained(tmp_path)
    assert model.lm_head.weight is model.wte.weight
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)
    save_pretrained(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)
