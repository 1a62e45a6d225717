"""Hugging Face tokenizers for ``--data`` and ``moebit generate`` (moebit's GPT stays bytes).

A corpus is tokenized once and cached as raw uint16 (vocabularies up to 65536) or uint32
ids, memory-mapped on later runs, under a key of the corpus bytes and the tokenizer file:
a changed corpus or tokenizer makes a new cache, never a stale one. The result is a
``moebit.training.data.Corpus`` of ids, so the rank-sharded training windows and validation
batches work on it unchanged.

    tok = load_tokenizer("path/to/model")          # its tokenizer.json
    corpus = tokenize_corpus(load_corpus(path), tok_path, cache_dir)
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(path: str | Path) -> Path:
    """``path`` itself (a tokenizer.json) or ``path/tokenizer.json``; an error otherwise."""
    p = Path(path)
    f = p / TOKENIZER_FILE if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"no tokenizer at {p} (expected a {TOKENIZER_FILE})")
    return f


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_file(path)))
