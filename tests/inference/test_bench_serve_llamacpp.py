"""``moebit bench serve --peer llamacpp``: the byte tokenizer gives token i = byte i (what
llama.cpp's GGUF byte vocabulary gives), and, with the optional ``llamacpp`` extra, both
servers answer the same requests on the tiny configuration. Skipped with the reason
without the extra."""

from __future__ import annotations

import json

import pytest
import torch

from moebit.bench.serve_llamacpp import available, byte_tokenizer
from moebit.models.tokenizer import HFTokenizer


def test_agreement_of_replies_that_differ_only_in_undecodable_bytes():
    from moebit.bench.serve_llamacpp import agreement

    assert agreement("a\ufffdb\ufffd", "ab")["agree"]
    assert agreement("ab\ufffd", "abc")["agree"]  # llama.cpp decoded on to a whole character
    assert not agreement("ab", "ac")["agree"]


def test_byte_tokenizer_is_the_identity_on_bytes(tmp_path):
    """Token i is byte i, in the same alphabet the GGUF files hold."""
    import json

    from moebit.bench.gguf_convert import byte_level_alphabet

    byte_tokenizer(tmp_path)
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab == {ch: i for i, ch in enumerate(byte_level_alphabet())}
    tok = HFTokenizer.from_folder(tmp_path)
    text = "def f(x):\n    return 'é' + \"\\t\"  "
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(list(range(128))) == bytes(range(128)).decode("ascii")
    assert tok.decode(list(text.encode("utf-8"))) == text


@pytest.mark.skipif(available() is not None, reason=str(available()))
@pytest.mark.timeout(600)
def test_serve_against_llamacpp_server_on_tiny(tmp_path):
    pytest.importorskip("transformers")
    from moebit.bench import serve

    out = tmp_path / "s.json"
    threads = torch.get_num_threads()
    try:
        assert serve.main(["--peer", "llamacpp", "--peer-config", "tiny", "--clients", "1", "2",
                           "--requests", "4", "--reps", "1", "--threads", "1",
                           "--peer-qtypes", "F32", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    rows = res["rows"]["F32"]
    for c in ("1", "2"):
        row = rows["clients"][c]
        assert row["moebit_tokens_per_s"] > 0 and row["llamacpp_tokens_per_s"] > 0
        for side in ("moebit_last", "llamacpp_last"):
            assert row[side]["completed"] == row[side]["requests"] == 4 * int(c)
            assert row[side]["5xx"] == 0 and row[side]["lost"] == 0
    agree = rows["greedy_agreement"]  # same prompt ids, F32 logits alike
    assert agree["agree"] and agree["compared_chars"] >= 4, agree
