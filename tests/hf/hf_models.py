"""Tiny random transformers models of each family and a tiny tokenizer, made locally
(nothing downloaded); the moebit CLI in a subprocess and a small real-text corpus."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, decoder_sparse_step=1,
                      mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      head_dim=8, norm_topk_prob=True, decoder_sparse_step=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, clip_qkv=8.0, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None),
}


def spread_routers_and_norms(model) -> None:
    """Routers start at zero in some families and norms at one: give them a spread (a
    dropped norm or a wrong routing then shows), and DeepSeek-style selection biases
    (``e_score_correction_bias``) a nonzero value that changes which experts are picked."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)


def make_hf_model(family: str, folder: Path, seed: int = 0, *, settings: dict | None = None,
                  spread: Callable[[object], None] = spread_routers_and_norms, **overrides):
    """A random transformers model of ``family`` saved in ``folder``; returns it (eval, fp32).

    ``settings``: its config (default: BASE with FAMILIES[family]), ``overrides`` on top;
    ``spread`` moves chosen weights off their init values before the save."""
    import torch

    torch.manual_seed(seed)
    settings = {**BASE, **FAMILIES[family]} if settings is None else settings
    cfg = transformers.AutoConfig.for_model(family, **{**settings, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    spread(model)
    model.save_pretrained(folder)
    return model.eval()


def token_ids(b: int = 2, t: int = 13, seed: int = 1, vocab: int = 96):
    """A (b, t) batch of random token ids below ``vocab``, the same for a given seed."""
    import torch

    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def train_tokenizer(folder: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE tokenizer trained on a few KB of the stdlib (nothing downloaded)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:20000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def run_moebit(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """``moebit ARGS`` in a subprocess, one thread per rank, its caches under ``tmp``."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moebit.cli", *args], env=env, text=True,
                          capture_output=True, timeout=400, check=False)


def text_corpus(tmp: Path, chars: int) -> Path:
    """The first ``chars`` characters of the stdlib's argparse.py, as data.txt in ``tmp``."""
    f = tmp / "data.txt"
    f.write_text((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()[:chars])
    return f


def forward_both(ref, model, ids):
    """transformers' forward (labels, router logits) and moebit's (on shifted targets, and
    on the whole sequence) over ``ids``; asserts that the logits and every MoE layer's
    router logits agree. Returns (transformers' output, moebit's loss output, moebit's
    full output) for the family's own checks."""
    import torch

    with torch.no_grad():
        r = ref(ids, labels=ids, output_router_logits=True)
        o = model(ids[:, :-1], ids[:, 1:])
        full = model(ids)
    torch.testing.assert_close(full.logits, r.logits, atol=1e-4, rtol=0)
    assert len(full.ffn_outputs) == len(r.router_logits) == len(model.config.moe_layers)
    for a, b in zip(r.router_logits, full.ffn_outputs, strict=True):
        torch.testing.assert_close(b.router_logits, a.float(), atol=1e-4, rtol=0)
    return r, o, full
