"""GLM-4.5 MoE and MiniMax-M2 against transformers on tiny random checkpoints (fp32).

Each family's model is written once per module by transformers itself (``save_pretrained``,
its per-expert layout), with a random ``e_score_correction_bias`` so that the fixed
selection bias changes which experts are picked, and every test reads that folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hf_models import forward_both, make_hf_model, run_moebit, text_corpus, token_ids, train_tokenizer

from moebit.hf import build_empty, from_pretrained, load_hf_weights, read_config, save_pretrained
from moebit.inference.generate import generate_tokens
from moebit.models.hf.config import HFDecoderConfig
from moebit.models.hf.folder import check_folder
from moebit.moe import MoE, MoEConfig, update_router_biases_
from moebit.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
NEW = {
    # group-limited (4 groups of 2, best 2 kept), scaled, q/k norms and biases, one dense layer
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                     intermediate_size=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     use_qk_norm=True, attention_bias=True, first_k_dense_replace=1,
                     n_shared_experts=1),
    # MiniMax's legacy rotary_dim: 8 of the 16 dimensions of a head rotate
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                       rotary_dim=8, router_aux_loss_coef=0.02, bos_token_id=None,
                       eos_token_id=1),
}


def make_new_model(family: str, folder: Path, seed: int = 0, **overrides):
    """This file's families (BASE with NEW[family]) through hf_models.make_hf_model."""
    return make_hf_model(family, folder, seed, settings={**BASE, **NEW[family]},
                         **overrides)


@pytest.fixture(scope="module", params=sorted(NEW))
def made(request, tmp_path_factory):
    """(family, folder, transformers model) shared by the tests of one family."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_new_model(request.param, folder)


def test_logits_router_logits_and_loss_match(made):
    family, folder, ref = made
    model = from_pretrained(folder)
    ids = token_ids()
    r, o, full = forward_both(ref, model, ids)
    if family == "glm4_moe":  # transformers' GLM computes no load-balancing loss
        assert r.aux_loss is None and float(full.aux_loss) == 0.0
        assert model.config.moe_layers == [1, 2]
    else:
        coef = ref.config.router_aux_loss_coef
        torch.testing.assert_close(full.aux_loss, coef * r.aux_loss.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(o.loss + full.aux_loss, r.loss, atol=1e-4, rtol=0)


def test_partial_rope_and_selection_bias_are_used(made):
    """Both are real: rotating whole heads, or routing without the bias, moves the logits."""
    family, folder, ref = made
    model = from_pretrained(folder)
    assert model.config.partial_rotary_factor == 0.5 and model.rotary_emb.inv_freq.numel() == 4
    gate = model.blocks[model.config.moe_layers[0]].mlp.gate
    want = ref.model.layers[model.config.moe_layers[0]].mlp
    bias_ref = want.gate.e_score_correction_bias if family == "glm4_moe" else want.e_score_correction_bias
    torch.testing.assert_close(gate.e_score_correction_bias, bias_ref, atol=0, rtol=0)
    ids = token_ids()
    with torch.no_grad():
        base = model(ids).logits
        for layer in model.config.moe_layers:
            model.blocks[layer].mlp.gate.e_score_correction_bias.zero_()
        assert (model(ids).logits - base).abs().max() > 1e-3
        whole = from_pretrained(folder)
        whole.config = whole.config.replace(partial_rotary_factor=1.0)
        whole.rotary_emb = type(whole.rotary_emb)(whole.config.rope)
        assert (whole(ids).logits - base).abs().max() > 1e-3


def test_greedy_generation_matches(made):
    _, folder, ref = made
    model = from_pretrained(folder)
    ids = token_ids(2, 7, seed=3)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=10, min_new_tokens=10)
    got = generate_tokens(model, ids.tolist(), max_new_tokens=10, temperature=0).tokens
    assert got == want[:, 7:].tolist()


def test_save_pretrained_round_trip(made, tmp_path):
    family, folder, _ = made
    model = from_pretrained(folder)
    with torch.no_grad():  # move off the source weights (and biases) so a no-op save would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for layer in model.config.moe_layers:
            model.blocks[layer].mlp.gate.e_score_correction_bias.add_(0.05)
    save_pretrained(model, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    bias = [n for n in index["weight_map"] if n.endswith("e_score_correction_bias")]
    assert len(bias) == len(model.config.moe_layers)
    if family == "glm4_moe":
        assert any(".mlp.shared_experts.gate_proj." in n for n in index["weight_map"])
    else:
        assert all(".block_sparse_moe." in n for n in bias)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
        again = from_pretrained(tmp_path / "out")
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)


def _ep_rank(rank: int, world: int, folder: str, out: str) -> dict:
    torch.set_num_threads(1)
    model = build_empty(read_config(folder, ep_size=world)).eval()
    report = load_hf_weights(model, folder)
    with torch.no_grad():
        logits = model(token_ids(2, 9, seed=5)).logits
        got = generate_tokens(model, token_ids(2, 5, seed=6).tolist(), max_new_tokens=4,
                              temperature=0).tokens
    save_pretrained(model, out)
    return {"logits": logits, "read": report.tensors_read, "generated": got}


def test_ep2_matches_one_process(made, tmp_path):
    family, folder, ref = made
    results = run_on_ranks(_ep_rank, world=2, args=(str(folder), str(tmp_path / "out")),
                           timeout=240)
    single = from_pretrained(folder)
    with torch.no_grad():
        want = single(token_ids(2, 9, seed=5)).logits
    want_gen = generate_tokens(single, token_ids(2, 5, seed=6).tolist(), max_new_tokens=4,
                               temperature=0).tokens
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["logits"], want, atol=1e-5, rtol=0)
        assert res["generated"] == want_gen
        experts = {int(m.group(1)) for n in res["read"] if (m := re.search(r"\.experts\.(\d+)\.", n))}
        assert experts == set(range(4 * rank, 4 * rank + 4))
    with torch.no_grad():  # the EP-saved folder (an expert shard per rank) loads everywhere
        torch.testing.assert_close(from_pretrained(tmp_path / "out")(token_ids(2, 9, seed=5)).logits,
                                   want, atol=0, rtol=0)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(back(token_ids(2, 9, seed=5)).logits, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("family", "optimizer"), [("glm4_moe", "onebit_adam"),
                                                   ("minimax_m2", "zero_one_adam")])
def test_train_init_from_ep2_resume_and_export(family, optimizer, tmp_path):
    """``train --init-from`` on 2 ranks with ep 2 and a 1-bit optimizer, ``--resume`` to a
    later step, then ``export``: transformers reads the trained folder."""
    src = tmp_path / "hf"
    make_new_model(family, src, vocab_size=320)
    train_tokenizer(src)
    run = tmp_path / "run"
    r = run_moebit(["train", "--init-from", str(src), "--data", str(text_corpus(tmp_path, 20000)),
                    "--block-size", "32", "--batch-size", "2", "--threads", "1", "--steps", "2",
                    "--nproc", "2", "--ep-size", "2", "--optimizer", optimizer,
                    "--eval-every", "2", "--eval-batches", "1", "--dtype", "fp32",
                    "--warmup-steps", "1", "--samples", "0", "--save-every", "2",
                    "--run-dir", str(run)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_moebit(["train", "--resume", str(run), "--steps", "3", "--nproc", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ends = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["steps"] for e in ends if e["kind"] == "end"][-1] == 3
    r = run_moebit(["export", str(run), "--to", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    orig = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    mine = from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, mine(ids).logits, atol=1e-4, rtol=0)
        assert (orig(ids).logits - back(ids).logits).abs().max() > 1e-3  # it did train
    for layer in mine.config.moe_layers:  # the checkpoint's bias is fixed: training keeps it
        torch.testing.assert_close(mine.blocks[layer].mlp.gate.e_score_correction_bias,
                                   _bias_of(orig, family, layer), atol=0, rtol=0)


def _bias_of(model, family: str, layer: int) -> torch.Tensor:
    mlp = model.model.layers[layer].mlp
    return mlp.gate.e_score_correction_bias if family == "glm4_moe" else mlp.e_score_correction_bias


def test_fixed_selection_bias_is_held_not_moved():
    """MoEConfig.score_correction_bias: the gate holds a bias that picks but never moves."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, scoring_func="sigmoid",
                    score_correction_bias=True, drop_tokens=False, d_ffn=8, expert_type="swiglu")
    moe = MoE(16, cfg).train()
    gate = moe.gate
    assert gate.e_score_correction_bias is not None and gate.load_since_update is None
    x = torch.randn(32, 16)
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))
    moe(x).hidden.sum().backward()  # training forward counts nothing, no error
    assert update_router_biases_(moe) == 0
    torch.testing.assert_close(gate.e_score_correction_bias, torch.tensor([0.0, 0.0, 5.0, 5.0]))
    _, _, expert_SK, weight_SK = gate.choose(x)
    assert set(expert_SK.flatten().tolist()) == {2, 3}  # the bias decides the pick...
    scores = torch.sigmoid(gate.router(x))[:, 2:]  # ...the plain scores the weights
    torch.testing.assert_close(weight_SK.sort(-1).values,
                               (scores / scores.sum(-1, keepdim=True)).sort(-1).values)
    assert "gate.e_score_correction_bias" in moe.state_dict()  # saved with the checkpoint
    with pytest.raises(ValueError, match="score_correction_bias"):
        MoEConfig(score_correction_bias="yes")


def _cfg(family: str, **extra) -> dict:
    cfg = transformers.AutoConfig.for_model(family, **{**BASE, **NEW[family]}).to_dict()
    return {**cfg, **extra}


def test_glm_defaults_when_keys_are_absent():
    """A config.json without the GLM keys means transformers' defaults: partial RoPE 0.5,
    the first layer dense, one shared expert."""
    hf = _cfg("glm4_moe")
    for key in ("rope_parameters", "first_k_dense_replace", "n_shared_experts"):
        hf.pop(key)
    cfg = HFDecoderConfig.from_hf({**hf, "rope_theta": 10000.0})
    assert cfg.partial_rotary_factor == 0.5 and cfg.moe_layers == [1, 2]
    assert cfg.shared_expert_intermediate_size == 16 and not cfg.shared_expert_gated
    assert cfg.to_hf()["first_k_dense_replace"] == 1


@pytest.mark.parametrize(("family", "extra", "named"), [
    ("minimax_m2", {"scoring_func": "softmax"}, "scoring_func"),
    ("minimax_m2", {"qk_norm_type": "per_head"}, "qk_norm_type"),
    ("minimax_m2", {"attn_type_list": [0, 1, 1]}, "attn_type_list"),
    ("minimax_m2", {"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ("glm4_moe", {"hidden_act": "gelu"}, "hidden_act"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                      "partial_rotary_factor": 0.1}}, "partial_rotary_factor"),
])
def test_unsupported_options_are_named(family, extra, named):
    with pytest.raises(ValueError, match=named):
        HFDecoderConfig.from_hf(_cfg(family, **extra))


def test_partial_rope_only_where_the_family_has_it():
    hf = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        HFDecoderConfig.from_hf(hf)


def test_missing_selection_bias_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_new_model("glm4_moe", tmp_path, num_hidden_layers=2)
    sd = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    del sd[name]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        load_hf_weights(build_empty(read_config(tmp_path)), tmp_path)
    # the whole-folder check before any rank starts (headers only) names it too
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        check_folder(tmp_path, tokenizer="ignore")


def test_fused_5x_layout_loads(made, tmp_path):
    """A checkpoint holding transformers 5.x's in-memory names (fused experts, MiniMax's
    bias under ``mlp.``) loads to the same logits."""
    from safetensors.torch import save_file

    _, _, ref = made
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ref.config.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(token_ids()).logits, ref(token_ids()).logits, atol=1e-4, rtol=0)


def test_bfloat16_keeps_the_selection_bias_float32(made):
    _, folder, _ = made
    model = from_pretrained(folder, dtype=torch.bfloat16)
    gate = model.blocks[model.config.moe_layers[0]].mlp.gate
    assert model.wte.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(gate.e_score_correction_bias,
                               from_pretrained(folder).blocks[model.config.moe_layers[0]]
                               .mlp.gate.e_score_correction_bias, atol=0, rtol=0)


def test_released_config_spellings():
    """The released config.json spellings (4.x keys: top-level rope_theta and
    partial_rotary_factor, MiniMax's rotary_dim and its own routing switches)."""
    common = {"vocab_size": 8, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3,
              "num_experts_per_tok": 2, "rope_theta": 1e6, "rope_scaling": None}
    glm = HFDecoderConfig.from_hf({**common, "model_type": "glm4_moe", "n_routed_experts": 4,
                                   "moe_intermediate_size": 8, "intermediate_size": 16,
                                   "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1,
                                   "eos_token_id": [1, 2]})
    assert (glm.partial_rotary_factor, glm.rope_theta, glm.moe_layers) == (0.5, 1e6, [1, 2])
    assert (glm.num_experts, glm.moe_intermediate_size, glm.scoring_func) == (4, 8, "sigmoid")
    mm = HFDecoderConfig.from_hf({**common, "model_type": "minimax_m2", "num_local_experts": 4,
                                  "intermediate_size": 8, "rotary_dim": 4,
                                  "scoring_func": "sigmoid", "use_routing_bias": True,
                                  "use_qk_norm": True, "qk_norm_type": "per_layer",
                                  "attn_type_list": [1, 1, 1]})
    assert (mm.partial_rotary_factor, mm.rope.dim, mm.moe_layers) == (0.25, 4, [0, 1, 2])
    assert mm.qk_norm == "full" and mm.norm_topk_prob and mm.score_correction_bias
