"""Tiny random transformers models of each family and a tiny tokenizer, made locally
(nothing downloaded); the moebit CLI in a subprocess and a small real-text corpus."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
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


def make_hf_model(family: str, folder: Path, seed: int = 0, **overrides):
    """A random transformers model of ``family`` saved in ``folder``; returns it (eval, fp32)."""
    import torch

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(family, **{**BASE, **FAMILIES[family], **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # routers start at zero in some families: give them a spread
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(folder)
    return model.eval()


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
