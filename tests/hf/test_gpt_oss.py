"""gpt-oss and FlexOlmo against transformers on tiny random checkpoints (fp32): the parity
fixture (logits, router logits, aux loss, loss, greedy generation, the save -> transformers
round trip, ep 2 equal to one process), then gpt-oss's own parts: attention sinks and a
sliding window smaller than the sequences, padded batched decoding past the window,
MXFP4 experts, and its unsupported options named.

Each family's model is written once per module by transformers itself (``save_pretrained``);
gpt-oss's biases and sinks are drawn wide so that dropping any of them would show.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest
import torch
from hf_models import forward_both, make_hf_model, run_moebit, text_corpus, token_ids, train_tokenizer

from moebit.hf import build_empty, from_pretrained, load_hf_weights, read_config, save_pretrained
from moebit.inference.generate import generate_tokens
from moebit.models.hf import mxfp4
from moebit.models.hf.config import HFDecoderConfig
from moebit.models.hf.tokens import load_tokenizer
from moebit.testing import run_on_ranks

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))  # moebit serve in a subprocess
from serve_helpers import Server  # noqa: E402

WINDOW = 4  # gpt-oss's sliding window here: smaller than every test sequence
BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
FAMILIES = {
    # layers 0 and 2 slide, layer 1 is full; yarn RoPE (transformers' default for gpt-oss)
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=4, intermediate_size=32,
                    sliding_window=WINDOW, router_aux_loss_coef=0.02),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=40,
                      norm_topk_prob=True, pad_token_id=0, eos_token_id=None, bos_token_id=None),
}


def spread_wide(model) -> None:
    """Norms, routers, and gpt-oss's biases and sinks off their init values, the biases and
    sinks wide, so that dropping any of them would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(("gate.weight", "router.weight")):
                p.normal_(0.0, 0.3)
            elif "bias" in name or name.endswith("sinks"):
                p.normal_(0.0, 0.5)


def make_model(family: str, folder: Path, seed: int = 0, **overrides):
    """This file's families (BASE with FAMILIES[family]) through hf_models.make_hf_model."""
    return make_hf_model(family, folder, seed, settings={**BASE, **FAMILIES[family]},
                         spread=spread_wide, **overrides)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, transformers model)}, made once for the module."""
    out = {}
    for family in sorted(FAMILIES):
        folder = tmp_path_factory.mktemp(family)
        out[family] = (folder, make_model(family, folder))
    return out


@pytest.fixture(params=sorted(FAMILIES))
def made(request, folders):
    return (request.param, *folders[request.param])


def test_logits_router_logits_and_loss_match(made):
    family, folder, ref = made
    model = from_pretrained(folder)
    ids = token_ids()
    r, o, full = forward_both(ref, model, ids)
    assert len(model.config.moe_layers) == 3
    coef = ref.config.router_aux_loss_coef
    torch.testing.assert_close(full.aux_loss, coef * r.aux_loss.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(o.loss + full.aux_loss, r.loss, atol=1e-4, rtol=0)
    if family == "flex_olmo":
        assert model.config.post_norm
    else:
        c = model.config
        assert (c.sliding_window, c.layer_types[:2]) == (WINDOW, ["sliding_attention", "full_attention"])
        assert c.rope_type == "yarn" and c.attention_sinks and c.num_experts_per_tok == 4


def test_greedy_generation_matches_past_the_window(made):
    _, folder, ref = made
    model = from_pretrained(folder)
    ids = token_ids(2, 7, seed=3)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=10, min_new_tokens=10)
    got = generate_tokens(model, ids.tolist(), max_new_tokens=10, temperature=0, eos=[]).tokens
    assert got == want[:, 7:].tolist()


def test_save_pretrained_round_trip(made, tmp_path):
    family, folder, _ = made
    model = from_pretrained(folder)
    with torch.no_grad():  # move off the source weights (biases, sinks) so a no-op save would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
        again = from_pretrained(tmp_path / "out")
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)


def _ep_rank(rank: int, world: int, folders: dict, outs: dict) -> dict:
    torch.set_num_threads(1)
    res = {}
    for family, folder in folders.items():
        model = build_empty(read_config(folder, ep_size=world)).eval()
        report = load_hf_weights(model, folder)
        with torch.no_grad():
            logits = model(token_ids(2, 9, seed=5)).logits
            got = generate_tokens(model, token_ids(2, 5, seed=6).tolist(), max_new_tokens=6,
                                  temperature=0, eos=[]).tokens
        save_pretrained(model, outs[family])
        res[family] = {"logits": logits, "read": report.tensors_read, "generated": got}
    return res


@pytest.mark.timeout(600)
def test_ep2_matches_one_process(folders, tmp_path):
    """One spawned pool of 2 ranks for both families: logits, greedy decoding, the EP save."""
    srcs = {f: str(folders[f][0]) for f in FAMILIES}
    outs = {f: str(tmp_path / f) for f in FAMILIES}
    results = run_on_ranks(_ep_rank, world=2, args=(srcs, outs), timeout=300)
    for family in FAMILIES:
        single = from_pretrained(srcs[family])
        with torch.no_grad():
            want = single(token_ids(2, 9, seed=5)).logits
        want_gen = generate_tokens(single, token_ids(2, 5, seed=6).tolist(), max_new_tokens=6,
                                   temperature=0, eos=[]).tokens
        for res in results:
            torch.testing.assert_close(res[family]["logits"], want, atol=1e-5, rtol=0)
            assert res[family]["generated"] == want_gen
        with torch.no_grad():  # the EP-saved folder loads in one process and in transformers
            torch.testing.assert_close(from_pretrained(outs[family])(token_ids(2, 9, seed=5)).logits,
                                       want, atol=0, rtol=0)
            back = transformers.AutoModelForCausalLM.from_pretrained(outs[family]).eval()
            torch.testing.assert_close(back(token_ids(2, 9, seed=5)).logits, want, atol=1e-4, rtol=0)
    assert any(n.endswith("experts.gate_up_proj") for n in results[1]["gpt_oss"]["read"])


def test_sinks_and_window_are_real(folders):
    """Without the sinks, or with every layer full, the logits move past the window."""
    folder, _ = folders["gpt_oss"]
    model = from_pretrained(folder)
    ids = token_ids(1, 13)
    with torch.no_grad():
        base = model(ids).logits
        for block in model.blocks:
            block.self_attn.window = None
        full = model(ids).logits
        assert (full[:, :WINDOW] - base[:, :WINDOW]).abs().max() < 1e-5  # same inside it
        assert (full[:, WINDOW:] - base[:, WINDOW:]).abs().max() > 1e-3
        plain = from_pretrained(folder)
        for block in plain.blocks:
            block.self_attn.sinks.fill_(-1e4)  # a sink of weight 0: plain softmax
        assert (plain(ids).logits - base).abs().max() > 1e-3


def test_padded_batch_decoding_matches_each_prompt_alone(folders):
    """Prompts of different lengths decode together (left padding, windows on the cache)
    to what transformers gives each prompt on its own."""
    folder, ref = folders["gpt_oss"]
    model = from_pretrained(folder)
    prompts = [token_ids(1, 9, seed=7)[0].tolist(), token_ids(1, 3, seed=8)[0].tolist()]
    got = generate_tokens(model, prompts, max_new_tokens=8, temperature=0, eos=[]).tokens
    for p, g in zip(prompts, got, strict=True):
        ids = torch.tensor([p])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=8, min_new_tokens=8)
        assert g == want[0, len(p):].tolist()


def _mxfp4_folder(src: Path, dst: Path) -> None:
    """``src`` with its expert weights in MXFP4 (transformers' names and layout)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(sd.pop(k).transpose(1, 2))  # output-major rows
        sd[f"{k}_blocks"], sd[f"{k}_scales"] = blocks, scales
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))


def test_mxfp4_experts_dequantize_as_transformers(folders, tmp_path):
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, _ = folders["gpt_oss"]
    _mxfp4_folder(folder, tmp_path / "mx")
    sd = load_file(str(tmp_path / "mx" / "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    want = convert_moe_packed_tensors(sd[f"{name}_blocks"], sd[f"{name}_scales"], dtype=torch.float32)
    got = mxfp4.dequantize(sd[f"{name}_blocks"], sd[f"{name}_scales"]).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    orig = load_file(str(folder / "model.safetensors"))[name]
    assert 0 < (got - orig).abs().max() < 0.25 * orig.abs().max()  # quantized, and close
    model = from_pretrained(tmp_path / "mx")
    ids = token_ids()
    save_pretrained(model, tmp_path / "out")  # exported dequantized, no quantization_config
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
    pytest.importorskip("accelerate", reason="transformers reads MXFP4 folders only with accelerate")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mx", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)


def _cfg(**extra) -> dict:
    cfg = transformers.AutoConfig.for_model("gpt_oss", **{**BASE, **FAMILIES["gpt_oss"]}).to_dict()
    return {**cfg, **extra}


@pytest.mark.parametrize(("extra", "named"), [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_unsupported_options_are_named(extra, named):
    with pytest.raises(ValueError, match=named):
        HFDecoderConfig.from_hf(_cfg(**extra))


def test_transformers_defaults_fill_a_sparse_config():
    hf = {k: v for k, v in _cfg().items() if k not in ("layer_types", "rope_parameters",
                                                         "swiglu_limit", "rms_norm_eps")}
    cfg = HFDecoderConfig.from_hf(hf)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor) == ("yarn", 150000.0, 32.0)
    assert (cfg.swiglu_limit, cfg.rms_norm_eps, cfg.swiglu_up_shift) == (7.0, 1e-5, 1.0)


@pytest.mark.timeout(1500)  # four subprocesses (two of them 2-rank) on a loaded 2-core host
def test_train_init_from_ep2_export_generate_serve(tmp_path):
    """moebit train --init-from a gpt-oss folder with 2 expert-parallel ranks, export, then
    ``moebit generate`` and ``moebit serve`` on the export give moebit's greedy tokens."""
    src = tmp_path / "hf"
    make_model("gpt_oss", src, vocab_size=320)
    train_tokenizer(src)
    run = tmp_path / "run"
    r = run_moebit(["train", "--init-from", str(src), "--data", str(text_corpus(tmp_path, 20000)),
                    "--block-size", "16", "--batch-size", "2", "--threads", "1", "--steps", "2",
                    "--eval-every", "2", "--eval-batches", "1", "--dtype", "fp32", "--nproc", "2",
                    "--ep-size", "2", "--warmup-steps", "1", "--samples", "0", "--save-every", "2",
                    "--run-dir", str(run)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_moebit(["export", str(run), "--to", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    orig = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    mine = from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, mine(ids).logits, atol=1e-4, rtol=0)
        assert (orig(ids).logits - back(ids).logits).abs().max() > 1e-3  # it did train
    sinks = [n for n, _ in back.named_parameters() if n.endswith("sinks")]
    assert len(sinks) == 3
    tok = load_tokenizer(tmp_path / "out")
    prompt = "def wrap(text, width"  # longer than the window in tokens, and so is the answer
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert len(ids) > WINDOW
    want = tok.decode(generate_tokens(mine, [ids], 8, temperature=0, eos=[]).tokens[0])
    r = run_moebit(["generate", str(tmp_path / "out"), "--prompt", prompt, "--temperature", "0",
                    "--max-new-tokens", "8", "--threads", "1"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(prompt + want)
    with Server(tmp_path / "out", "--context", "64", "--max-batch", "2",
                start_timeout=600) as server:  # a loaded host starts it slowly
        got = httpx.post(server.url + "/v1/completions", timeout=120,
                         json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want


def test_the_server_runs_sinks_and_windows_with_its_two_forward_step(folders):
    """gpt-oss's attention reads the cache itself (sinks, windows), so the packed ragged
    step cannot carry it: the engine falls back to its two-forward step; FlexOlmo keeps the
    ragged step."""
    from moebit.models.tokenizer import ByteTokenizer
    from moebit.serve.engine import Engine

    for family, ragged in (("gpt_oss", False), ("flex_olmo", True)):
        model = from_pretrained(folders[family][0])
        assert model.supports_ragged is ragged
        assert Engine(model, ByteTokenizer(), max_batch=2).legacy is (not ragged)


def test_a_gpt_oss_student_keeps_its_layers_kinds_and_loads_in_transformers(folders, tmp_path):
    """Mixture-of-Students: the kept layers keep their sliding/full kind (and their
    tensors, sinks included), and transformers computes what moebit computes."""
    import transformers

    from moebit.distill.students import choose_layers
    from moebit.distill.teacher import write_student

    teacher = from_pretrained(folders["gpt_oss"][0]).eval()
    keep = choose_layers(teacher.config, 2)
    student = write_student(teacher, keep, tmp_path / "student")
    t_sd = teacher.state_dict()
    for name, p in student.state_dict().items():
        src = name
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            src = f"blocks.{keep[int(i)]}.{rest}"
        assert torch.equal(p, t_sd[src]), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "student").eval()
    assert back.config.layer_types == [teacher.config.layer_types[i] for i in keep]
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, back(ids).logits, atol=1e-4, rtol=0)
