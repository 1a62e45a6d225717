"""Corpora as a Hugging Face tokenizer's ids, for ``--data`` under ``--init-from``.

A corpus is tokenized once and cached as raw uint16 (vocabularies up to 65536) or uint32
ids, memory-mapped on later runs, under a key of the corpus bytes and the tokenizer file:
a changed corpus or tokenizer makes a new cache, never a stale one. The result is a
``Corpus`` of ids, so the rank-sharded training windows and validation batches work on
it unchanged.

    corpus = tokenize_corpus(load_corpus(path), tok_path, cache_dir)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from moebit.models.hf.tokens import TOKENIZER_FILE, tokenizer_file
from moebit.training.data import Corpus


def _dtype(vocab: int) -> type:
    return np.uint16 if vocab <= 1 << 16 else np.uint32


def _encode(tok: Tokenizer, data: np.ndarray, dtype: type) -> np.ndarray:
    """Ids of a corpus split, encoded line block by line block (bounded memory)."""
    text = bytes(data).decode("utf-8", errors="replace")
    chunks = text.splitlines(keepends=True)
    out: list[np.ndarray] = []
    step = 4096
    for i in range(0, len(chunks), step):
        encs = tok.encode_batch(chunks[i:i + step], add_special_tokens=False)
        out.extend(np.asarray(e.ids, dtype=dtype) for e in encs)
    return np.concatenate(out) if out else np.zeros(0, dtype=dtype)


def tokenize_corpus(corpus: Corpus, tokenizer_path: str | Path, cache_dir: str | Path) -> Corpus:
    """The corpus as token ids, from the cache when this corpus + tokenizer was seen before."""
    tfile = tokenizer_file(tokenizer_path)
    tok = Tokenizer.from_file(str(tfile))
    dtype = _dtype(tok.get_vocab_size())
    h = hashlib.sha256()
    for part in (corpus.train, corpus.val):
        h.update(len(part).to_bytes(8, "little"))
        h.update(memoryview(np.ascontiguousarray(part)))
    h.update(tfile.read_bytes())
    key = h.hexdigest()[:24]
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    splits = {}
    for name, data in (("train", corpus.train), ("val", corpus.val)):
        f = cache / f"{key}.{name}.{np.dtype(dtype).name}"
        if not f.is_file():
            ids = _encode(tok, data, dtype)
            # Every rank of a run may get here at once: each writes its own temporary file
            # and the renames (atomic, same content) leave one whole cache file.
            tmp = f.with_suffix(f"{f.suffix}.{os.getpid()}.tmp")
            ids.tofile(tmp)
            tmp.replace(f)
        splits[name] = np.memmap(f, dtype=dtype, mode="c")  # writable view: torch shares it
    return Corpus(train=splits["train"], val=splits["val"],
                  source=f"{corpus.source} ({tfile} ids)", n_files=corpus.n_files)


def cache_dir_default() -> Path:
    """``$XDG_CACHE_HOME/moebit/tokens`` (else ~/.cache/moebit/tokens)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moebit" / "tokens"


def corpus_for_model(corpus: Corpus, model_dir: str | Path | None, vocab_size: int) -> Corpus:
    """A model's training corpus: ids of its folder's tokenizer.json when it has one, else
    the raw bytes (only where the vocabulary covers all 256 byte values); a model with no
    folder (moebit's GPT) reads bytes."""
    if model_dir is None:
        return corpus
    if (Path(model_dir) / TOKENIZER_FILE).is_file():
        return tokenize_corpus(corpus, model_dir, cache_dir_default())
    if vocab_size < 256:
        raise ValueError(f"{model_dir} has no {TOKENIZER_FILE} and its vocabulary "
                         f"({vocab_size}) is too small for byte ids")
    return corpus
