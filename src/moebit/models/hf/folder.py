"""A Hugging Face model folder as files: the checks that it loads, and what travels with it.

``check_folder`` is what every command runs before it loads a folder (or starts a rank
that would): ``config.json`` is a config moebit implements, every weight file opens as
safetensors, every tensor the config implies is there with its shape (from the files'
headers: no tensor data is read), and the tokenizer files parse. Each problem is one
``HFFolderError`` (a ValueError) naming the file, so a command prints one line and
exits 2 instead of a traceback from a rank.

The side files (tokenizer, chat template, generation config, ...) are every top-level
file but the weights and ``config.json``: ``export``, ``upcycle`` and the distillation
student copy them, so transformers' ``AutoTokenizer`` loads the result as it loaded the
source, chat template included.

    cfg = check_folder("path/to/model", tokenizer="required")   # generate, serve
    copy_side_files(src, out)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moebit.models.hf.config import HFDecoderConfig, read_config
from moebit.models.hf.decoder import HFDecoder
from moebit.models.hf.tokens import TOKENIZER_FILE
from moebit.models.hf.weights import INDEX, SINGLE, HFFolderError, check_hf_weights
from moebit.models.meta import on_meta

# weights and their indexes in every format transformers reads: never side files, and what
# `moebit export --overwrite` clears (a stale model.safetensors beside new shards would
# be what transformers loads)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                   "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack")
# the tokenizer and generation files transformers reads next to the weights
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json",
                      "chat_template*", "generation_config.json", "vocab.*", "merges.txt",
                      "spiece.model", "preprocessor_config.json")
TOKENIZER_CONFIG = "tokenizer_config.json"


def _matches(f: Path, patterns: tuple[str, ...]) -> bool:
    return any(f.match(p) for p in patterns)


def side_files(src: str | Path) -> list[Path]:
    """The top-level files of ``src`` that travel with a model: all but its weights,
    ``config.json`` (rewritten by whoever copies) and hidden files."""
    return [f for f in sorted(Path(src).iterdir())
            if f.is_file() and not f.name.startswith(".") and f.name != "config.json"
            and not _matches(f, WEIGHT_PATTERNS)]


def copy_side_files(src: str | Path, out: str | Path) -> list[str]:
    """Copy ``side_files(src)`` into ``out``; returns their names."""
    names = []
    for f in side_files(src):
        shutil.copy2(f, Path(out) / f.name)
        names.append(f.name)
    return names


def model_files(folder: str | Path) -> list[Path]:
    """The top-level files of ``folder`` that make the model and its tokenizer (config,
    weights, tokenizer and generation files): what a new export replaces."""
    return [f for f in sorted(Path(folder).iterdir()) if f.is_file() and (
        f.name == "config.json" or _matches(f, WEIGHT_PATTERNS + TOKENIZER_PATTERNS))]


def looks_like_hf_folder(path: str | Path) -> bool:
    """A folder meant as a Hugging Face model, loadable or not: a ``config.json`` beside
    safetensors weights, or one that does not parse or names a ``model_type`` (a moebit
    run's config.json is valid JSON without one). Such a folder gets ``check_folder``'s
    errors, not "has no complete checkpoint"."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    if (p / SINGLE).is_file() or (p / INDEX).is_file() or any(p.glob("*.safetensors")):
        return True
    try:
        hf = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True
    except OSError:
        return False
    return isinstance(hf, dict) and "model_type" in hf


def check_config(path: str | Path) -> HFDecoderConfig:
    """``config.json``, read as moebit reads it; its errors name the file."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise HFFolderError(f"{p / 'config.json'} does not exist: not a Hugging Face model folder")
    try:
        return read_config(p)
    except ValueError as e:
        raise HFFolderError(str(e)) from None


def check_weights(cfg: HFDecoderConfig, path: str | Path) -> None:
    """Every tensor the config implies, present with its shape, in readable files."""
    with on_meta():  # shapes only: no memory for the weights
        model = HFDecoder(cfg.replace(ep_size=1))
    check_hf_weights(model, path)


def check_tokenizer(path: str | Path, required: bool, vocab_size: int) -> bool:
    """The folder's ``tokenizer.json`` parses and its ids fit the model's vocabulary, and
    ``tokenizer_config.json`` (the chat template's home) is a JSON object. Returns whether
    there is a tokenizer; a missing one is an error when ``required``."""
    from tokenizers import Tokenizer

    p = Path(path)
    tfile = p / TOKENIZER_FILE
    if not tfile.is_file():
        if required:
            raise HFFolderError(f"{tfile} does not exist: the model's tokenizer is needed to "
                                "turn text into its token ids")
        return False
    try:
        tok = Tokenizer.from_file(str(tfile))
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise HFFolderError(f"{tfile}: not a valid tokenizer ({e})") from None
    n = tok.get_vocab_size(with_added_tokens=False)  # its ids index the embedding
    if n > vocab_size:
        raise HFFolderError(f"{tfile}: {n} tokens, more than config.json's vocab_size "
                            f"{vocab_size} (the wrong model's tokenizer?)")
    tcfg = p / TOKENIZER_CONFIG
    if tcfg.is_file():
        try:
            meta = json.loads(tcfg.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFFolderError(f"{tcfg} is not valid JSON: {e}") from None
        if not isinstance(meta, dict):
            raise HFFolderError(f"{tcfg} is not a JSON object")
    return True


def check_folder(path: str | Path, tokenizer: str = "optional") -> HFDecoderConfig:
    """Everything a load of ``path`` needs, checked before the load; returns its config.

    ``tokenizer``: "required" (text in and out: generate, serve), "optional" (training
    falls back to byte ids, which need a vocabulary of at least 256) or "ignore"."""
    if tokenizer not in ("required", "optional", "ignore"):
        raise ValueError(f"tokenizer must be required, optional or ignore, got {tokenizer!r}")
    cfg = check_config(path)
    check_weights(cfg, path)
    if tokenizer == "required":
        # a byte-level vocabulary (exactly 256 ids) reads and writes UTF-8 bytes without one
        check_tokenizer(path, cfg.vocab_size != 256, cfg.vocab_size)
    elif tokenizer == "optional":
        check_training_tokenizer(path, cfg.vocab_size)
    return cfg


def check_training_tokenizer(path: str | Path, vocab_size: int) -> None:
    """Training's rule: the folder's tokenizer when it has one (it must parse), else raw
    byte ids, which need a vocabulary of at least 256."""
    if not check_tokenizer(path, False, vocab_size) and vocab_size < 256:
        raise HFFolderError(f"{Path(path) / TOKENIZER_FILE} does not exist and the "
                            f"vocabulary ({vocab_size}) is too small for byte ids")
