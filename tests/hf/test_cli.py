"""The tool on a Hugging Face folder: train --init-from (EP 2, resume), generate, export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import make_hf_model, run_moebit, text_corpus, train_tokenizer

from moebit.inference.loading import load_model
from moebit.models.hf.tokens import load_tokenizer
from moebit.training.data import load_corpus
from moebit.training.tokenized import tokenize_corpus

transformers = pytest.importorskip("transformers")


def test_tokenized_corpus_is_cached_by_corpus_and_tokenizer(tmp_path):
    tok = train_tokenizer(tmp_path / "tok")
    corpus = load_corpus(str(text_corpus(tmp_path, 40000)))
    a = tokenize_corpus(corpus, tok, tmp_path / "cache")
    assert a.train.dtype == np.uint16 and len(list((tmp_path / "cache").iterdir())) == 2
    text = bytes(corpus.val).decode()
    assert load_tokenizer(tok).decode(a.val.tolist()) == text
    b = tokenize_corpus(corpus, tok, tmp_path / "cache")  # same key: read back, not re-made
    assert np.array_equal(a.train, b.train) and len(list((tmp_path / "cache").iterdir())) == 2
    train_tokenizer(tmp_path / "tok", vocab_size=300)  # another tokenizer: another cache
    tokenize_corpus(corpus, tok, tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 4


@pytest.mark.slow
def test_train_ep2_resume_export_generate(tmp_path):
    src = tmp_path / "hf"
    make_hf_model("qwen2_moe", src, vocab_size=320)
    train_tokenizer(src)
    run = tmp_path / "run"
    common = ["--init-from", str(src), "--data", str(text_corpus(tmp_path, 40000)), "--block-size", "32",
              "--batch-size", "2", "--threads", "1", "--eval-every", "2", "--eval-batches", "1",
              "--dtype", "fp32", "--warmup-steps", "1", "--samples", "0"]
    r = run_moebit(["train", *common, "--steps", "2", "--nproc", "2", "--ep-size", "2",
                 "--optimizer", "onebit_adam", "--save-every", "2", "--run-dir", str(run)],
                tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads(next(run.glob("checkpoints/*/manifest.json")).read_text())
    assert manifest["ep_size"] == 2 and manifest["model_config"]["model_type"] == "qwen2_moe"
    r = run_moebit(["train", "--resume", str(run), "--steps", "4", "--nproc", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ends = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["steps"] for e in ends if e["kind"] == "end"][-1] == 4
    r = run_moebit(["export", str(run), "--to", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    model = load_model(run)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    orig = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
        assert (orig(ids).logits - model(ids).logits).abs().max() > 1e-3  # it did train
    r = run_moebit(["eval", str(run)], tmp_path)  # scored on the tokenizer's ids
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_moebit(["generate", str(tmp_path / "out"), "--prompt", "def ", "--temperature", "0",
                 "--max-new-tokens", "5", "--threads", "1"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("def ")


def _tokenize_into(args: tuple[str, str, str]) -> int:
    corpus_dir, tok, cache = args
    from moebit.training.data import load_corpus

    return len(tokenize_corpus(load_corpus(corpus_dir), tok, cache).train)


def test_ranks_tokenizing_into_one_cache_at_once_all_succeed(tmp_path):
    """Every rank of a run tokenizes the corpus: concurrent writers must not collide."""
    import multiprocessing as mp

    tok = str(train_tokenizer(tmp_path / "tok"))
    corpus = str(text_corpus(tmp_path, 40000))
    with mp.get_context("spawn").Pool(3) as pool:
        for i in range(3):
            cache = str(tmp_path / f"cache{i}")
            lengths = pool.map(_tokenize_into, [(corpus, tok, cache)] * 3)
            assert len(set(lengths)) == 1 and lengths[0] > 0
            assert not list(Path(cache).glob("*.tmp"))
