"""Issue 21 item 9: skipped corpus files are reported (reason, bytes) in one summary line,
a corpus mostly skipped is refused unless allowed, and Latin-1 is "not UTF-8"."""

from __future__ import annotations

from pathlib import Path

import pytest

from moebit.cli import main as cli
from moebit.training.data import CorpusError, load_corpus


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "latin.txt").write_bytes(("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n" * 4000).encode("latin-1"))
    (d / "blob.bin").write_bytes(b"\x00\x01\x02\x03" * 20_000)
    (d / "README").write_text("# a small readme\n" * 100)
    return d


def test_mostly_skipped_corpus_is_refused_with_the_summary(mixed: Path):
    with pytest.raises(CorpusError) as e:
        load_corpus(str(mixed), allow_skipped=False)
    msg = str(e.value)
    assert "more than half its bytes would be skipped" in msg and "--allow-skipped" in msg
    assert "latin.txt not UTF-8 (byte 0xe9 at offset 3" in msg
    assert "blob.bin looks binary (NUL bytes) (80.0 KB)" in msg
    assert "latin.txt looks binary" not in msg


def test_allowed_skips_are_listed_in_one_line(mixed: Path):
    corpus = load_corpus(str(mixed), allow_skipped=True)
    line = corpus.summary()
    assert "\n" not in line
    assert line.startswith("data: 1 files (1.7 KB) used; skipped 2 files (")
    assert corpus.skipped_bytes == 80_000 + len((mixed / "latin.txt").read_bytes())


def test_encoding_and_replace_read_latin1(mixed: Path):
    latin = load_corpus(str(mixed), encoding="latin-1", allow_skipped=False)
    assert latin.n_files == 2 and "caf\u00e9".encode() in bytes(latin.train) + bytes(latin.val)
    replaced = load_corpus(str(mixed), errors="replace", allow_skipped=False)
    assert replaced.n_files == 2 and "\ufffd".encode() in bytes(replaced.train) + bytes(replaced.val)


def test_train_prints_the_refusal_as_one_line(mixed: Path, tmp_path: Path, capsys):
    rc = cli(["train", "--data", str(mixed), "--run-dir", str(tmp_path / "r"), "--block-size", "32"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "not UTF-8" in err
    assert not (tmp_path / "r").exists()
