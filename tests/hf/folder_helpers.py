"""Hugging Face folders with a full tokenizer (chat template included) and moebit runs
trained --init-from them, made in-process in a second (no rank is launched)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import make_hf_model, train_tokenizer

from moebit.comm.collectives import DistInfo
from moebit.hf import from_pretrained
from moebit.training.config import build
from moebit.training.data import TrainBatches
from moebit.training.state import save

transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def add_tokenizer(folder: Path) -> None:
    """A trained BPE saved the way transformers saves one: tokenizer.json,
    tokenizer_config.json, chat_template.jinja (transformers 5) and a generation config."""
    raw = train_tokenizer(folder / "raw", vocab_size=318)  # + <s>, </s>: the model's 320
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(raw), eos_token="</s>",
                                               bos_token="<s>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    for f in (folder / "raw").iterdir():
        f.unlink()
    (folder / "raw").rmdir()


def hf_folder(folder: Path, family: str = "mixtral") -> Path:
    """A random ``family`` model (vocabulary 320) with a full tokenizer, in ``folder``."""
    make_hf_model(family, folder, vocab_size=320)
    add_tokenizer(folder)
    return folder


def hf_run(src: Path, run: Path, step: int = 1, seed: int = 0) -> torch.nn.Module:
    """A run folder "trained" --init-from ``src``: one checkpoint of its model with every
    weight moved a little, saved as ``moebit train`` saves it; returns that model."""
    cfg = build({"init_from": str(src), "samples": 0, "block_size": 16, "run_dir": str(run)})
    model = from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    opt = torch.optim.Adam(model.parameters())
    batches = TrainBatches(np.arange(1000, dtype=np.uint16), 16, 2, 0, 0)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    save(run, step, model, opt, batches, DistInfo(0, 1, 0, torch.device("cpu"), None), cfg,
         wall=0.0, train_time=0.0)
    return model.eval()
