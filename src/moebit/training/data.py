"""Byte-level corpora and rank-sharded batches.

With no path, the corpus is the Python standard library's own ``.py`` files: about 30 MB
of real text on every machine, so training needs no download. Train and validation are
split by file with a hash of the relative path (stable across machines and runs).
Training batches are random windows from a per-rank seeded stream, so ranks see
different data; validation batches are fixed and identical on every rank.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

VAL_PER_MILLE = 20  # about 2% of files go to validation
_SNIFF_BYTES = 8192


class CorpusError(ValueError):
    """The corpus path is missing, empty, or not text."""


@dataclass
class Corpus:
    train: np.ndarray  # uint8 bytes
    val: np.ndarray
    source: str
    n_files: int
    used_bytes: int = 0
    skipped: list[tuple[str, str, int]] = field(default_factory=list)  # (file, reason, bytes)

    @property
    def skipped_bytes(self) -> int:
        return sum(n for _, _, n in self.skipped)

    def summary(self) -> str:
        return summary_line(self.n_files, self.used_bytes, self.skipped)

    def unigram_entropy(self) -> float:
        """Entropy of the training bytes' unigram distribution, in nats per byte.

        The loss of a model that learned byte frequencies and nothing else: a trained
        model must end clearly below it.
        """
        counts = np.bincount(self.train, minlength=256).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def summary_line(n_files: int, used: int, skipped: list[tuple[str, str, int]], limit: int = 5) -> str:
    """One line: what was used, and each skipped file with its reason and size."""
    line = f"data: {n_files} files ({_kb(used)}) used"
    if not skipped:
        return line
    parts = [f"{f} {why} ({_kb(n)})" for f, why, n in skipped[:limit]]
    more = len(skipped) - limit
    return (f"{line}; skipped {len(skipped)} files ({_kb(sum(n for _, _, n in skipped))}): "
            + ", ".join(parts) + (f", and {more} more" if more > 0 else ""))


_NOT_STDLIB = ("site-packages", "dist-packages")


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's .py files, sorted. Installed packages are pruned from the walk,
    not filtered after it: a Python's own site-packages can hold gigabytes, and every rank of
    every run on the default corpus lists these files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = [s for s in subdirs if s not in _NOT_STDLIB]
        files += [Path(d, n) for n in names if n.endswith(".py") and os.path.isfile(Path(d, n))]
    return root, sorted(files)


def is_validation(relpath: str) -> bool:
    h = int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:4], "little")
    return h % 1000 < VAL_PER_MILLE


def _kb(n: int) -> str:
    return f"{n / 1000:.1f} KB"


def skip_reason(head: bytes, encoding: str = "utf-8", errors: str = "strict") -> str | None:
    """Why a file is not text for this corpus (None: it is), judged on its first bytes.

    NUL bytes mean binary whatever the encoding; otherwise the bytes must decode, unless
    undecodable bytes are to be replaced.
    """
    if b"\x00" in head:
        return "looks binary (NUL bytes)"
    if errors == "replace":
        return None
    try:
        head.decode(encoding)
    except UnicodeDecodeError as e:
        # A multi-byte character cut at the sniff boundary is still text.
        if e.start < len(head) - 4:
            name = "UTF-8" if codecs.lookup(encoding).name == "utf-8" else encoding
            return (f"not {name} (byte 0x{head[e.start]:02x} at offset {e.start}; "
                    "see --encoding, --errors replace)")
    return None


def _looks_binary(head: bytes) -> bool:
    return skip_reason(head) is not None


def _as_utf8(data: bytes, encoding: str, errors: str) -> bytes:
    """The training bytes: UTF-8, as the byte-level model is trained on UTF-8 text."""
    if codecs.lookup(encoding).name == "utf-8" and errors == "strict":
        return data
    return data.decode(encoding, errors=errors).encode("utf-8")


def _resolve(path: str) -> tuple[Path, list[Path], bool]:
    """(root, files, explicit): ``explicit`` when the user named exactly one file."""
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
        if not files:
            raise CorpusError(f"--data {path!r}: the glob matches no files")
        return Path("."), files, False
    if not p.exists():
        raise CorpusError(f"--data {path!r}: no such file or folder")
    if p.is_file():
        return p.parent, [p], True
    files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    if not files:
        raise CorpusError(f"--data {path!r}: the folder holds no files")
    return p, files, False


def check_path(path: str | None, encoding: str = "utf-8", errors: str = "strict") -> None:
    """Cheap up-front check of ``--data`` (before any rank starts or any file is written).

    Resolves the path and sniffs files until one text file is found; a named binary
    file, a missing path or a corpus without text raise ``CorpusError`` naming it.
    """
    if path is None:
        return
    _, files, explicit = _resolve(path)
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(_SNIFF_BYTES)
        why = skip_reason(head, encoding, errors)
        if why:
            if explicit:
                raise CorpusError(f"--data {path!r}: {f} is {why}")
            continue
        if head:
            return
    raise CorpusError(f"corpus {path!r} holds no text (no non-empty text files)")


def load_corpus(path: str | None = None, encoding: str = "utf-8", errors: str = "strict",
                allow_skipped: bool = True) -> Corpus:
    """Read a corpus: the stdlib by default, else a text file, a folder, or a glob.

    A file named directly that is not text is an error; inside a folder or glob such files
    are skipped and listed in ``Corpus.skipped`` (a folder of sources often holds a few).
    More than half the bytes skipped is an error unless ``allow_skipped``: a corpus that
    silently shrank to a README is not what anyone meant to train on.
    """
    if path is None:
        root, files = stdlib_files()
        explicit, allow_skipped = False, True
        source = f"python stdlib ({root})"
    else:
        root, files, explicit = _resolve(path)
        source = path
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    skipped: list[tuple[str, str, int]] = []
    kept = used = 0
    for f in files:
        data = f.read_bytes()
        why = skip_reason(data[:_SNIFF_BYTES], encoding, errors)
        if why:
            if explicit:
                raise CorpusError(f"--data {path!r}: {f} is {why}")
            skipped.append((str(f), why, len(data)))
            continue
        if not data:
            continue
        try:
            data = _as_utf8(data, encoding, errors)
        except UnicodeDecodeError as e:
            raise CorpusError(f"{f}: not {encoding} at byte {e.start} (see --errors replace)") from None
        kept += 1
        used += len(data)
        rel = f.relative_to(root).as_posix() if f.is_relative_to(root) else f.as_posix()
        (val_parts if is_validation(rel) else train_parts).append(data)
    if kept == 0:
        raise CorpusError(f"corpus {source!r} holds no text (no non-empty text files)"
                          + (f": {summary_line(0, 0, skipped)}" if skipped else ""))
    if not allow_skipped and sum(n for _, _, n in skipped) > used:
        raise CorpusError(f"corpus {source!r}: more than half its bytes would be skipped "
                          f"({summary_line(kept, used, skipped)}); pass --allow-skipped to train "
                          "on the rest, or read the files with --encoding ENC or --errors replace")
    # bytearray: writable buffers, so torch.from_numpy shares them without a warning.
    train = np.frombuffer(bytearray(b"\n".join(train_parts)), dtype=np.uint8)
    val = np.frombuffer(bytearray(b"\n".join(val_parts)), dtype=np.uint8)
    if len(val) < len(train) // 200 or len(train) == 0:
        # Too few files for a split by file (e.g. one text file): hold out the tail.
        everything = np.frombuffer(bytearray(b"\n".join(train_parts + val_parts)), dtype=np.uint8)
        cut = int(len(everything) * (1 - VAL_PER_MILLE / 1000))
        train, val = everything[:cut], everything[cut:]
    return Corpus(train=train, val=val, source=source, n_files=kept, used_bytes=used,
                  skipped=skipped)


def check_block_size(corpus: Corpus, block_size: int) -> None:
    for name, arr in (("training", corpus.train), ("validation", corpus.val)):
        if len(arr) <= block_size + 1:
            raise CorpusError(
                f"the {name} split of {corpus.source!r} has {len(arr)} bytes, fewer than "
                f"block_size+1 = {block_size + 1}: use a larger corpus or a smaller --block-size"
            )


class TrainBatches:
    """Random windows of block_size+1 bytes from a stream seeded per (seed, rank).

    The generator state is the whole data position, so a checkpoint of it resumes exactly.
    """

    def __init__(
        self, data: np.ndarray, block_size: int, batch_size: int, seed: int, rank: int
    ) -> None:
        self.data = torch.from_numpy(data)
        self.block_size = block_size
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self._arange = torch.arange(block_size + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        hi = len(self.data) - self.block_size - 1
        starts = torch.randint(0, hi + 1, (self.batch_size,), generator=self.gen)
        win = self.data[starts[:, None] + self._arange].long()
        return win[:, :-1], win[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.gen.set_state(sd["gen"])


def val_batches(
    data: np.ndarray, block_size: int, batch_size: int, n_batches: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation windows, the same on every rank, spread evenly over the split."""
    t = torch.from_numpy(data)
    hi = len(t) - block_size - 1
    n = n_batches * batch_size
    gen = torch.Generator().manual_seed(seed + 12345)
    starts = torch.randint(0, hi + 1, (n,), generator=gen)
    win = t[starts[:, None] + torch.arange(block_size + 1)].long()
    return [
        (win[i : i + batch_size, :-1], win[i : i + batch_size, 1:])
        for i in range(0, n, batch_size)
    ]


def bits_per_byte(nats: float) -> float:
    return nats / math.log(2)
