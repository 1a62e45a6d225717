"""Dense Hugging Face families (Llama, Qwen2, Qwen3, OLMo2) in moebit and their upcycling
into Mixtral, Qwen2-MoE, Qwen3-MoE and FlexOlmo, with transformers as the oracle (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import BASE, make_hf_model, run_moebit, text_corpus, token_ids, train_tokenizer

from moebit.cli.upcycle import main as upcycle_main
from moebit.hf import from_pretrained, is_hf_folder, save_pretrained
from moebit.inference.generate import generate_tokens
from moebit.models.hf.upcycle import moe_config_json
from moebit.models.upcycling import UpcycleSpec
from moebit.upcycle.folders import upcycle_folder

transformers = pytest.importorskip("transformers")

_OLMO_IDS = {"pad_token_id": 0, "eos_token_id": None, "bos_token_id": None}  # in the vocabulary
DENSE = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 8}, "olmo2": _OLMO_IDS}


def spread_norms_and_biases(model) -> None:
    """Norms and biases off their init values, so that a dropped norm or bias would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)


def make_dense(family: str, folder: Path, seed: int = 0, **overrides):
    """A random dense transformers model saved in ``folder``, through make_hf_model."""
    return make_hf_model(family, folder, seed, settings={**BASE, **DENSE[family]},
                         spread=spread_norms_and_biases, **overrides)


def _load_hf(folder: Path):
    """transformers' model of ``folder``, checking that every tensor matched a parameter."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("family", sorted(DENSE))
def test_dense_family_matches_transformers(family, tmp_path):
    ref = make_dense(family, tmp_path / "src", tie_word_embeddings=family == "qwen2")
    model = from_pretrained(tmp_path / "src")
    assert not model.config.is_moe and model.ep_groups is None and model.num_expert_params() == 0
    ids = token_ids()
    with torch.no_grad():
        r = ref(ids, labels=ids)
        full = model(ids)
        shifted = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(full.logits, r.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(shifted.loss, r.loss, atol=1e-4, rtol=0)
    assert full.ffn_outputs == [] and float(full.aux_loss) == 0.0
    want = ref.generate(ids[:, :7], attention_mask=torch.ones_like(ids[:, :7]), do_sample=False,
                        max_new_tokens=8, min_new_tokens=8)
    got = generate_tokens(model, ids[:, :7].tolist(), max_new_tokens=8, temperature=0).tokens
    assert got == want[:, 7:].tolist()
    save_pretrained(model, tmp_path / "out")  # a dense model saves back as its family
    back = _load_hf(tmp_path / "out")
    assert type(back) is type(ref)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, r.logits, atol=1e-4, rtol=0)


def test_dense_family_options_that_do_not_load_are_named(tmp_path):
    make_dense("llama", tmp_path / "a", attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        from_pretrained(tmp_path / "a")
    make_dense("qwen2", tmp_path / "b", use_sliding_window=True, sliding_window=8,
               max_window_layers=1)
    with pytest.raises(ValueError, match="sliding"):
        from_pretrained(tmp_path / "b")


CASES = {  # id: (dense family, spec, MoE family, MoE layers)
    "llama-k2": ("llama", dict(num_experts=4, num_experts_per_tok=2), "mixtral", [0, 1, 2]),
    "llama-k1": ("llama", dict(num_experts=3, num_experts_per_tok=1), "mixtral", [0, 1, 2]),
    "qwen2-k2": ("qwen2", dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]),
                 "qwen2_moe", [1, 2]),
    "qwen2-k1": ("qwen2", dict(num_experts=4, num_experts_per_tok=1), "qwen2_moe", [0, 1, 2]),
    "qwen2-shared": ("qwen2", dict(num_experts=4, num_experts_per_tok=2, shared_expert=True),
                     "qwen2_moe", [0, 1, 2]),
    "olmo2-k2": ("olmo2", dict(num_experts=4, num_experts_per_tok=2), "flex_olmo", [0, 1, 2]),
    "qwen3-every2": ("qwen3", dict(num_experts=4, num_experts_per_tok=3, moe_every=2),
                     "qwen3_moe", [1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_upcycled_model_computes_the_dense_model(case, tmp_path):
    dense_family, spec, moe_family, layers = CASES[case]
    ref = make_dense(dense_family, tmp_path / "dense")
    upcycle_folder(tmp_path / "dense", tmp_path / "up", UpcycleSpec(**spec))
    up = _load_hf(tmp_path / "up")  # transformers loads it: every tensor in its place
    assert up.config.model_type == moe_family and is_hf_folder(tmp_path / "up")
    shards = set(json.loads((tmp_path / "up" / "model.safetensors.index.json").read_text())
                 ["weight_map"].values())
    assert len(shards) == 1 + len(layers)  # the dense tensors, then one shard per MoE layer
    ids = token_ids()
    with torch.no_grad():
        r = ref(ids).logits
        torch.testing.assert_close(up(ids).logits, r, atol=1e-4, rtol=0)
        ours = from_pretrained(tmp_path / "up")
        assert ours.config.moe_layers == layers
        assert ours.config.num_experts_per_tok == spec["num_experts_per_tok"]
        out = ours(ids)
        torch.testing.assert_close(out.logits, r, atol=1e-4, rtol=0)
    router = out.ffn_outputs[0].router_logits
    assert 0 < router.abs().max() < 0.05  # near zero, not a tie
    mlp = ref.model.layers[layers[0]].mlp
    experts = ours.blocks[layers[0]].mlp.experts
    f = experts.d_ffn
    for e in range(spec["num_experts"]):  # every expert a copy of the dense MLP
        assert torch.equal(experts.gate_up_proj[e, :f], mlp.gate_proj.weight)
        assert torch.equal(experts.gate_up_proj[e, f:], mlp.up_proj.weight)
        halved = 0.5 if spec.get("shared_expert") else 1.0
        assert torch.equal(experts.down_proj[e], halved * mlp.down_proj.weight)


def _ep_logits(rank: int, world: int, folder: str) -> dict:
    torch.set_num_threads(1)
    model = from_pretrained(folder, ep_size=world, rank=rank)
    with torch.no_grad():
        return {"logits": model(token_ids()).logits,
                "experts": model.blocks[0].mlp.experts.first_expert}


def test_upcycled_folder_under_expert_parallelism(tmp_path):
    """ep 2 on 2 gloo ranks: each rank holds half of the copies, the logits stay the dense ones."""
    from moebit.testing import run_on_ranks

    ref = make_dense("olmo2", tmp_path / "dense")
    upcycle_folder(tmp_path / "dense", tmp_path / "up", UpcycleSpec(num_experts=4))
    results = run_on_ranks(_ep_logits, world=2, args=(str(tmp_path / "up"),), timeout=240)
    with torch.no_grad():
        want = ref(token_ids()).logits
    assert [r["experts"] for r in results] == [0, 2]
    for r in results:
        torch.testing.assert_close(r["logits"], want, atol=1e-4, rtol=0)


def test_noise_and_unnormalised_weights_move_off_the_dense_model(tmp_path):
    ref = make_dense("qwen3", tmp_path / "dense")
    ids = token_ids()
    for name, spec in (("noise", dict(noise_std=0.05)), ("raw", dict(norm_topk_prob=False))):
        with pytest.warns(UserWarning, match="away from the dense"):
            upcycle_folder(tmp_path / "dense", tmp_path / name,
                       UpcycleSpec(num_experts=4, num_experts_per_tok=2, **spec))
        with torch.no_grad():
            gap = (_load_hf(tmp_path / name)(ids).logits - ref(ids).logits).abs().max()
        assert gap > 1e-3, name


def test_upcycle_is_deterministic_in_its_seed(tmp_path):
    from safetensors.torch import load_file

    make_dense("llama", tmp_path / "dense")
    spec = dict(num_experts=4, noise_std=0.01)
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        with pytest.warns(UserWarning, match="noised"):
            upcycle_folder(tmp_path / "dense", tmp_path / name, UpcycleSpec(**spec, seed=seed))
    shard = "model-00002-of-00004.safetensors"
    a, b, c = (load_file(tmp_path / n / shard) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_upcycle_keeps_the_checkpoint_dtype(tmp_path):
    from safetensors import safe_open

    make_dense("qwen3", tmp_path / "fp32").to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    upcycle_folder(tmp_path / "dense", tmp_path / "up", UpcycleSpec(num_experts=4, noise_std=0.0))
    assert json.loads((tmp_path / "up" / "config.json").read_text())["dtype"] == "bfloat16"
    for f in (tmp_path / "up").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            assert {h.get_tensor(k).dtype for k in h.keys()} == {torch.bfloat16}, f.name
    model = from_pretrained(tmp_path / "up", dtype="auto")
    assert model.blocks[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_a_missing_mlp_tensor_is_named_and_leaves_no_folder(tmp_path):
    from safetensors.torch import load_file, save_file

    make_dense("llama", tmp_path / "dense")
    f = tmp_path / "dense" / "model.safetensors"
    sd = load_file(f)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="no tensor model.layers.1.mlp.up_proj.weight"):
        upcycle_folder(tmp_path / "dense", tmp_path / "up", UpcycleSpec(num_experts=4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]  # no partial output


def test_config_keeps_the_dense_attention_and_sets_the_moe_keys():
    dense = {**BASE, "model_type": "qwen2", "intermediate_size": 40, "tie_word_embeddings": True,
             "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    cfg = moe_config_json(dense, UpcycleSpec(num_experts=8, num_experts_per_tok=2, moe_every=2))
    assert cfg["model_type"] == "qwen2_moe" and cfg["architectures"] == ["Qwen2MoeForCausalLM"]
    assert cfg["num_experts"] == 8 and cfg["moe_intermediate_size"] == 40
    assert cfg["shared_expert_intermediate_size"] == 0 and cfg["qkv_bias"] is True
    assert cfg["decoder_sparse_step"] == 2 and cfg["norm_topk_prob"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 5e5 and cfg["tie_word_embeddings"] is True


def test_cli_upcycles_a_hf_folder(tmp_path, capsys):
    ref = make_dense("qwen2", tmp_path / "dense", vocab_size=320)
    train_tokenizer(tmp_path / "dense")
    assert upcycle_main([str(tmp_path / "dense"), "--num-experts", "4", "--num-experts-per-tok",
                         "2", "--moe-every", "2", "--router-aux-loss-coef", "0.02",
                         "--run-dir", str(tmp_path / "up")]) == 0  # --run-dir is --out
    assert "(qwen2_moe, 4 experts, top-2)" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "up" / "config.json").read_text())
    assert cfg["decoder_sparse_step"] == 2 and cfg["router_aux_loss_coef"] == 0.02
    assert (tmp_path / "up" / "tokenizer.json").read_bytes() == (
        tmp_path / "dense" / "tokenizer.json").read_bytes()
    ids = token_ids(vocab=320)
    with torch.no_grad():
        torch.testing.assert_close(_load_hf(tmp_path / "up")(ids).logits, ref(ids).logits,
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("args, message", [
    (["--num-experts", "2", "--num-experts-per-tok", "3"], "num_experts = 2 < num_experts_per_tok = 3"),
    (["--num-experts", "4", "--moe-every", "2"], "mixtral has no dense layers"),
    (["--num-experts", "4", "--shared-expert"], "shared_expert is Qwen2-MoE's"),
    (["--num-experts", "4,4"], "one expert count"),
    (["--num-experts", "4", "--set", "capacity_factor=1"], "--set sets training-config keys"),
])
def test_cli_errors_name_the_problem(args, message, tmp_path, capsys):
    make_dense("llama", tmp_path / "dense")
    assert upcycle_main([str(tmp_path / "dense"), *args, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_refuses_moe_and_unknown_families_and_a_used_folder(tmp_path, capsys):
    from hf_models import make_hf_model

    make_hf_model("mixtral", tmp_path / "moe")
    assert upcycle_main([str(tmp_path / "moe"), "--num-experts", "4", "--out",
                         str(tmp_path / "o")]) == 2
    assert "already an MoE model (model_type 'mixtral')" in capsys.readouterr().err
    make_dense("llama", tmp_path / "gpt2")
    cfg = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    assert upcycle_main([str(tmp_path / "gpt2"), "--num-experts", "4", "--out",
                         str(tmp_path / "o")]) == 2
    assert "model_type 'gpt2' cannot be upcycled" in capsys.readouterr().err
    make_dense("llama", tmp_path / "dense")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    assert upcycle_main([str(tmp_path / "dense"), "--num-experts", "4", "--out",
                         str(tmp_path / "used")]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_cli_hf_only_flags_on_a_run_are_named(tmp_path, capsys):
    assert upcycle_main([str(tmp_path / "run"), "--num-experts", "4", "--shared-expert",
                         "--run-dir", str(tmp_path / "o")]) == 2
    assert "--shared-expert: for Hugging Face folders only" in capsys.readouterr().err


@pytest.mark.slow
def test_tool_on_a_dense_folder_and_its_upcycled_copy(tmp_path):
    """generate and train a dense Qwen3 folder, eval its run, upcycle it with the CLI, and
    train the upcycled folder: its first loss is the dense model's."""
    dense = tmp_path / "dense"
    make_dense("qwen3", dense, vocab_size=320)
    train_tokenizer(dense)
    r = run_moebit(["generate", str(dense), "--prompt", "def ", "--temperature", "0",
                 "--max-new-tokens", "4", "--threads", "1"], tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr[-3000:]
    common = ["--data", str(text_corpus(tmp_path, 20000)), "--block-size", "32", "--batch-size", "2",
              "--threads", "1", "--eval-every", "3", "--eval-batches", "1", "--dtype", "fp32",
              "--warmup-steps", "1", "--samples", "0", "--steps", "3", "--lr", "1e-3",
              "--log-every", "1"]
    losses = {}
    for name, src in (("dense", dense), ("up", tmp_path / "up")):
        if name == "up":
            assert run_moebit(["upcycle", str(dense), "--num-experts", "4", "--num-experts-per-tok",
                            "2", "--out", str(src)], tmp_path).returncode == 0
            assert (src / "tokenizer.json").is_file()
        run = tmp_path / f"run-{name}"
        r = run_moebit(["train", "--init-from", str(src), *common, "--run-dir", str(run)], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [x["loss"] for x in recs if x.get("kind") == "train"]
        assert [x["steps"] for x in recs if x["kind"] == "end"] == [3]
    r = run_moebit(["eval", str(tmp_path / "run-dense")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses["up"][0] == pytest.approx(losses["dense"][0], abs=1e-4)
