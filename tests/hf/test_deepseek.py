"""DeepSeek-V3 and DeepSeek-V2 (multi-head latent attention) against transformers, fp32.

Each family's tiny random model is written once per module by transformers itself
(``save_pretrained``): V3 with a low-rank query (``q_lora_rank``), yarn RoPE with both
mscales and a random ``e_score_correction_bias``; V2 with a plain ``q_proj`` and
``group_limited_greedy`` routing. Every test reads those folders; the expert-parallel
checks of both families share one spawned pool of 2 ranks.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest
import torch
from hf_models import forward_both, make_hf_model, run_moebit, text_corpus, token_ids, train_tokenizer

from moebit.hf import build_empty, from_pretrained, load_hf_weights, read_config, save_pretrained
from moebit.inference.generate import generate_tokens
from moebit.models.hf.config import HFDecoderConfig
from moebit.models.hf.mla import MLAttention, cache_bytes_per_token
from moebit.testing import run_on_ranks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # small matmuls: one thread is faster

BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            intermediate_size=48, n_group=4, topk_group=2, first_k_dense_replace=1,
            max_position_embeddings=128)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 32}
NEW = {
    "deepseek_v3": dict(q_lora_rank=32, routed_scaling_factor=2.5, n_shared_experts=1,
                        rope_parameters=YARN),
    "deepseek_v2": dict(q_lora_rank=None, topk_method="group_limited_greedy",
                        routed_scaling_factor=1.5, n_shared_experts=2),
}


def make_model(family: str, folder: Path, seed: int = 0, **overrides):
    """This file's families (BASE with NEW[family]) through hf_models.make_hf_model."""
    return make_hf_model(family, folder, seed, settings={**BASE, **NEW[family]},
                         **overrides)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """{family: (folder, transformers model)} for both families, made once."""
    out = {}
    for family in sorted(NEW):
        folder = tmp_path_factory.mktemp(family)
        out[family] = (folder, make_model(family, folder))
    return out


@pytest.fixture(params=sorted(NEW))
def made(request, built):
    return (request.param, *built[request.param])


def test_logits_router_logits_and_loss_match(made):
    family, folder, ref = made
    model = from_pretrained(folder)
    assert model.config.is_mla and model.config.moe_layers == [1, 2]
    assert isinstance(model.blocks[0].self_attn, MLAttention)
    ids = token_ids()
    r, o, full = forward_both(ref, model, ids)
    # transformers' DeepSeek models compute no load-balancing loss: neither does moebit
    assert r.aux_loss is None and float(full.aux_loss) == 0.0
    torch.testing.assert_close(o.loss, r.loss, atol=1e-4, rtol=0)


def test_routing_and_rope_options_are_used(made):
    """Each option is real: V3 without its selection bias, V2 scoring groups by their best
    two experts instead of the best one, and V3 without yarn's scales move the logits."""
    family, folder, _ = made
    model = from_pretrained(folder)
    ids = token_ids()
    with torch.no_grad():
        base = model(ids).logits
        cfg = read_config(folder)
        if family == "deepseek_v3":
            assert cfg.scoring_func == "sigmoid" and cfg.rope_type == "yarn"
            assert model.blocks[0].self_attn.scale != (8 + 8) ** -0.5  # mscale_all_dim
            for layer in cfg.moe_layers:
                model.blocks[layer].mlp.gate.e_score_correction_bias.zero_()
            changed = [model(ids).logits]
            other = cfg.replace(rope_type="default", rope_factor=1.0, rope_params={})
        else:
            assert (cfg.scoring_func, cfg.group_score, cfg.q_lora_rank) == ("softmax", "max", None)
            other = cfg.replace(group_score="top2_sum")
            changed = []
        m2 = build_empty(other)
        load_hf_weights(m2, folder)
        changed.append(m2(ids).logits)
    for logits in changed:  # the parity above is ~1e-7: a move of 1e-4 is the option's
        assert (logits - base).abs().max() > 1e-4


def test_greedy_generation_matches(made):
    _, folder, ref = made
    model = from_pretrained(folder)
    ids = token_ids(2, 7, seed=3)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=10, min_new_tokens=10)
    got = generate_tokens(model, ids.tolist(), max_new_tokens=10, temperature=0).tokens
    assert got == want[:, 7:].tolist()


def _count_absorbed(monkeypatch) -> list[int]:
    """Record the query count of every absorbed-form attention call."""
    calls: list[int] = []
    real = MLAttention._absorbed

    def spy(self, q_nope, *a):
        calls.append(q_nope.shape[2])
        return real(self, q_nope, *a)

    monkeypatch.setattr(MLAttention, "_absorbed", spy)
    return calls


def test_latent_cache_decoding_equals_the_full_forward(made, monkeypatch):
    """The cache holds kv_lora_rank + qk_rope_head_dim numbers per token and layer (as
    many bytes as transformers' own cache, measured by the benchmark's row); a long
    prefill chunk (plain form over the cached latents), a short chunk and single steps
    (absorbed form) give the full forward's logits."""
    from moebit.bench.hf_mla import cache_rows

    family, folder, ref = made
    model = from_pretrained(folder)
    c = model.config
    ids = token_ids(2, 40, seed=7)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2, 48)
        assert all(k is v for k, v in zip(cache.k, cache.v, strict=True))
        assert cache_bytes_per_token(cache) == c.num_layers * (16 + 8) * 4
        full_kv = c.num_layers * c.num_heads * (8 + 8 + 12) * 4  # an expanded K/V cache
        assert full_kv / cache_bytes_per_token(cache) == pytest.approx(112 / 24)
        assert cache_rows(ref, model) == {"moebit_kv_cache_bytes_per_token": 3 * 24 * 4,
                                          "hf_kv_cache_bytes_per_token": 3 * 24 * 4,
                                          "expanded_kv_bytes_per_token": full_kv}
        calls = _count_absorbed(monkeypatch)
        attn = model.blocks[0].self_attn
        assert not attn._absorbs(30) and attn._absorbs(4) and attn._absorbs(1)
        pieces = [model(ids[:, :30], cache=cache).logits]
        assert calls == []  # the 30-token chunk ran the plain form
        pieces.append(model(ids[:, 30:34], cache=cache).logits)
        for j in range(34, 40):
            pieces.append(model(ids[:, j:j + 1], cache=cache).logits)
    assert calls == [4] * c.num_layers + [1] * c.num_layers * 6
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=0)


def test_padded_rows_and_server_slots_decode_as_the_full_forward(made):
    """Prompts of different lengths (left padding: masks in the absorbed form) and the
    server's slot cache (built by the model's new_cache) decode greedily as repeated full
    forwards do."""
    from moebit.serve.slot_cache import SlotKVCache

    _, folder, _ = made
    model = from_pretrained(folder)
    prompts = [token_ids(1, 9, seed=11)[0].tolist(), token_ids(1, 4, seed=12)[0].tolist()]

    def greedy_full(p: list[int], n: int) -> list[int]:
        out = list(p)
        with torch.no_grad():
            for _ in range(n):
                out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
        return out[len(p):]

    want = [greedy_full(p, 6) for p in prompts]
    assert generate_tokens(model, prompts, max_new_tokens=6, temperature=0).tokens == want
    slots = SlotKVCache.for_model(model, slots=3, scratch=8)
    got: list[list[int]] = [[], []]
    with torch.no_grad():
        for i, (slot, p) in enumerate(zip((2, 0), prompts, strict=True)):  # a prefill per slot
            slots.bind([slot])
            got[i].append(int(model(torch.tensor([p]), cache=slots).logits[0, -1].argmax()))
        for _ in range(5):  # both slots per step, lengths differ: the mask path
            slots.bind([2, 0])
            last = torch.tensor([[got[0][-1]], [got[1][-1]]])
            nxt = model(last, cache=slots, logits_to_keep=1).logits[:, -1].argmax(-1)
            got[0].append(int(nxt[0]))
            got[1].append(int(nxt[1]))
    assert got == want


def test_save_pretrained_round_trip(made, tmp_path):
    family, folder, _ = made
    model = from_pretrained(folder)
    with torch.no_grad():  # move off the source weights (and bias) so a no-op save would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        if family == "deepseek_v3":
            for layer in model.config.moe_layers:
                model.blocks[layer].mlp.gate.e_score_correction_bias.add_(0.05)
    save_pretrained(model, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    names = index["weight_map"]
    assert ("model.layers.0.self_attn.q_proj.weight" in names) == (family == "deepseek_v2")
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in names
    bias = [n for n in names if n.endswith("e_score_correction_bias")]
    assert len(bias) == (2 if family == "deepseek_v3" else 0)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
        again = from_pretrained(tmp_path / "out")
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)


def _ep_rank(rank: int, world: int, folders: dict, out: str) -> dict:
    torch.set_num_threads(1)
    res = {}
    for family, folder in folders.items():
        model = build_empty(read_config(folder, ep_size=world)).eval()
        report = load_hf_weights(model, folder)
        with torch.no_grad():
            logits = model(token_ids(2, 9, seed=5)).logits
            got = generate_tokens(model, token_ids(2, 5, seed=6).tolist(), max_new_tokens=4,
                                  temperature=0).tokens
        save_pretrained(model, f"{out}/{family}")
        res[family] = {"logits": logits, "read": report.tensors_read, "generated": got}
    return res


def test_ep2_matches_one_process(built, tmp_path):
    folders = {f: str(folder) for f, (folder, _) in built.items()}
    results = run_on_ranks(_ep_rank, world=2, args=(folders, str(tmp_path)), timeout=240)
    ids = token_ids(2, 9, seed=5)
    for family, folder in folders.items():
        single = from_pretrained(folder)
        with torch.no_grad():
            want = single(ids).logits
        want_gen = generate_tokens(single, token_ids(2, 5, seed=6).tolist(), max_new_tokens=4,
                                   temperature=0).tokens
        for rank, res in enumerate(r[family] for r in results):
            torch.testing.assert_close(res["logits"], want, atol=1e-5, rtol=0)
            assert res["generated"] == want_gen
            experts = {int(m.group(1)) for n in res["read"]
                       if (m := re.search(r"\.experts\.(\d+)\.", n))}
            assert experts == set(range(4 * rank, 4 * rank + 4))
        with torch.no_grad():  # the EP-saved folder (an expert shard per rank) loads everywhere
            torch.testing.assert_close(from_pretrained(tmp_path / family)(ids).logits, want,
                                       atol=0, rtol=0)
            back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
            torch.testing.assert_close(back(ids).logits, want, atol=1e-4, rtol=0)


def test_rope_in_halves_matches(tmp_path):
    """V3 with ``rope_interleave`` false rotates halves, as transformers does then."""
    ref = make_model("deepseek_v3", tmp_path, rope_interleave=False, rope_parameters=None)
    model = from_pretrained(tmp_path)
    assert not model.config.rope_interleave and model.config.rope_type == "default"
    with torch.no_grad():
        torch.testing.assert_close(model(token_ids()).logits, ref(token_ids()).logits, atol=1e-4, rtol=0)


def _cfg(family: str, **extra) -> dict:
    cfg = transformers.AutoConfig.for_model(family, **{**BASE, **NEW[family]}).to_dict()
    return {**cfg, **extra}


@pytest.mark.parametrize(("family", "extra", "named"), [
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("deepseek_v3", {"kv_lora_rank": None}, "kv_lora_rank"),
    ("deepseek_v3", {"q_lora_rank": 0}, "q_lora_rank"),
    ("deepseek_v3", {"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                         "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias"),
    ("deepseek_v2", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_options_are_named(family, extra, named):
    with pytest.raises(ValueError, match=named):
        HFDecoderConfig.from_hf(_cfg(family, **extra))


def test_released_config_spellings():
    """The released config.json spellings: V3's 4.x ``rope_scaling`` yarn with both mscales
    and its own routing switches, V2-Lite's greedy routing; keys left out take
    transformers' defaults, written back."""
    common = {"vocab_size": 8, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 4, "num_hidden_layers": 4, "intermediate_size": 16,
              "moe_intermediate_size": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
              "qk_rope_head_dim": 4, "v_head_dim": 4, "rope_theta": 10000,
              "max_position_embeddings": 163840}
    v3 = HFDecoderConfig.from_hf({**common, "model_type": "deepseek_v3", "q_lora_rank": 16,
                                  "n_routed_experts": 16, "num_experts_per_tok": 2,
                                  "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                                  "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
                                  "rope_scaling": {"type": "yarn", "factor": 40,
                                                   "beta_fast": 32, "beta_slow": 1,
                                                   "mscale": 1.0, "mscale_all_dim": 1.0,
                                                   "original_max_position_embeddings": 4096}})
    assert (v3.moe_layers, v3.n_group, v3.topk_group, v3.routed_scaling_factor) == ([3], 8, 4, 2.5)
    assert (v3.rope_type, v3.rope_factor, v3.head_dim, v3.num_kv_heads) == ("yarn", 40, 4, 4)
    assert v3.norm_topk_prob and v3.score_correction_bias and v3.rope_interleave
    assert v3.shared_expert_intermediate_size == 8 and v3.to_hf()["first_k_dense_replace"] == 3
    v2 = HFDecoderConfig.from_hf({**common, "model_type": "deepseek_v2", "q_lora_rank": None,
                                  "n_routed_experts": 8, "num_experts_per_tok": 2,
                                  "n_group": 1, "topk_group": 1, "topk_method": "greedy",
                                  "first_k_dense_replace": 1, "norm_topk_prob": False,
                                  "aux_loss_alpha": 0.001, "seq_aux": True})
    assert (v2.moe_layers, v2.n_group, v2.topk_group, v2.scoring_func) == ([1, 2, 3], 1, None, "softmax")
    assert v2.shared_expert_intermediate_size == 16 and v2.router_aux_loss_coef == 0.0


@pytest.mark.timeout(600)
def test_train_ep2_export_and_serve(tmp_path):
    """``moebit train --init-from`` a DeepSeek-V3 folder on 2 ranks with ep 2, ``export``
    (transformers loads it: same logits; the fixed selection bias kept), then ``moebit
    serve`` the exported folder: a greedy completion equals ``generate_tokens``."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
    from serve_helpers import Server

    from moebit.models.hf.tokens import load_tokenizer

    src = tmp_path / "hf"
    orig = make_model("deepseek_v3", src, vocab_size=320)
    train_tokenizer(src)
    run, out = tmp_path / "run", tmp_path / "out"
    r = run_moebit(["train", "--init-from", str(src), "--data", str(text_corpus(tmp_path, 20000)),
                    "--block-size", "32", "--batch-size", "2", "--threads", "1", "--steps", "3",
                    "--nproc", "2", "--ep-size", "2", "--eval-every", "3", "--eval-batches", "1",
                    "--dtype", "fp32", "--warmup-steps", "1", "--samples", "0",
                    "--save-every", "3", "--run-dir", str(run)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_moebit(["export", str(run), "--to", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    mine = from_pretrained(out)
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, mine(ids).logits, atol=1e-4, rtol=0)
        assert (orig(ids).logits - back(ids).logits).abs().max() > 1e-3  # it did train
    for layer in mine.config.moe_layers:
        torch.testing.assert_close(mine.blocks[layer].mlp.gate.e_score_correction_bias,
                                   orig.model.layers[layer].mlp.gate.e_score_correction_bias,
                                   atol=0, rtol=0)
    tok = load_tokenizer(out)
    prompt = "def wrap(text, width"
    want = generate_tokens(mine, [tok.encode(prompt, add_special_tokens=False).ids],
                           max_new_tokens=6, temperature=0, eos=None).tokens[0]
    with Server(out, "--context", "64", "--max-batch", "2") as s:
        resp = httpx.post(s.url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == tok.decode(want)


def test_a_student_keeps_the_teachers_layers_and_loads_in_transformers(made, tmp_path):
    """Mixture-of-Students for the MLA families: the student folder of 2 kept layers (the
    dense first layer and the last MoE one) holds the teacher's tensors, and transformers
    computes what moebit computes from it."""
    import transformers

    from moebit.distill.students import choose_layers
    from moebit.distill.teacher import write_student

    family, folder, _ = made
    teacher = from_pretrained(folder).eval()
    keep = choose_layers(teacher.config, 2)
    assert keep == [0, 2]
    student = write_student(teacher, keep, tmp_path / "student")
    t_sd = teacher.state_dict()
    for name, p in student.state_dict().items():
        src = name.replace("blocks.1.", "blocks.2.")
        assert torch.equal(p, t_sd[src]), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "student").eval()
    assert back.config.num_hidden_layers == 2 and back.config.first_k_dense_replace == 1
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, back(ids).logits, atol=1e-4, rtol=0)


def test_int8_projections_keep_the_absorbed_weight_float(made):
    """``--quantize int8`` (scope all) on MLA: every projection but ``kv_b_proj`` (whose
    weight the absorbed decode folds into the query) is int8, and greedy decoding still
    runs the latent cache with logits near float32's."""
    from moebit.inference.quantize_dense import QuantLinear, quantize_model_

    _, folder, _ = made
    ref = from_pretrained(folder).eval()
    model = from_pretrained(folder).eval()
    quantize_model_(model, 8, "all")
    attn = model.blocks[0].self_attn
    assert isinstance(attn.kv_b_proj, torch.nn.Linear) and isinstance(attn.o_proj, QuantLinear)
    assert isinstance(attn.kv_a_proj_with_mqa, QuantLinear)
    ids = token_ids(2, 9, seed=4)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert 0 < float((a - b).norm() / a.norm()) < 0.05
    toks = generate_tokens(model, ids.tolist(), max_new_tokens=6, temperature=0).tokens
    assert [len(t) for t in toks] == [6, 6]
