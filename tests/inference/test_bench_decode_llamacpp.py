"""The llama.cpp peer of ``moebit bench decode`` (the optional ``llamacpp`` extra): GGUF
files written from a moebit model hold the byte counts the floor assumes, llama.cpp on
the F32 file decodes the same greedy tokens as moebit, and the command runs with
``--peer llamacpp`` on the tiny configuration. Skipped, with the reason, without the
extra."""

from __future__ import annotations

import json

import pytest
import torch

from moebit.bench import decode_floor as fl
from moebit.bench.decode_llamacpp import available

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moebit.bench.decode import build_folder
    from moebit.models.hf import from_pretrained

    folder = tmp_path_factory.mktemp("tiny")
    build_folder("tiny", folder)
    return folder, from_pretrained(str(folder)).eval()


def test_gguf_tensors_and_bytes(tiny, tmp_path):
    import gguf

    from moebit.bench.gguf_convert import write_gguf

    folder, model = tiny
    dims = fl.Dims.of_config(model.config.hf)
    for qtype, fmt in (("Q8_0", "q8_0"), ("Q4_0", "q4_0"), ("F32", "f32")):
        r = gguf.GGUFReader(str(write_gguf(model, tmp_path / f"{qtype}.gguf", qtype)))
        t = {x.name: x for x in r.tensors}
        assert len(t) == 3 + 10 * dims.layers  # embedding, final norm, head
        exps = t["blk.0.ffn_gate_exps.weight"]
        assert exps.tensor_type.name == qtype
        assert int(exps.n_bytes) == dims.experts * fl.matrix_bytes(fmt, dims.f, dims.d)
        assert int(t["output.weight"].n_bytes) == fl.matrix_bytes(fmt, dims.vocab, dims.d)
        assert t["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"  # the router
        if qtype == "F32":  # the stored k rows are moebit's, permuted per head
            k = torch.from_numpy(t["blk.1.attn_k.weight"].data.copy()).reshape(-1, dims.d)
            from moebit.bench.gguf_convert import permute

            w = model.blocks[1].self_attn.k_proj.weight.detach()
            torch.testing.assert_close(k, permute(w, dims.kv_heads))


def test_llamacpp_greedy_matches_moebit(tiny, tmp_path):
    from moebit.bench.decode import prompts_of
    from moebit.bench.decode_llamacpp import LlamaCppPeer
    from moebit.inference.generate import generate_tokens

    _, model = tiny
    peer = LlamaCppPeer(model, tmp_path, threads=1, n_ctx=64, qtypes=("F32", "Q8_0"))
    try:
        prompt = prompts_of(1, 12)[0]
        runs = peer.runners(prompt)
        step_s, toks = runs["llamacpp_F32"](8)
        _, toks_again = runs["llamacpp_F32"](8)  # a fresh context each run
        ours = generate_tokens(model, [prompt], max_new_tokens=8, temperature=0, eos=[]).tokens[0]
        assert step_s > 0 and len(toks) == 8 and toks == toks_again
        assert toks[0] == ours[0]  # first-token agreement on F32
        assert sum(a == b for a, b in zip(toks, ours, strict=True)) >= 6
        assert len(runs["llamacpp_Q8_0"](4)[1]) == 4
    finally:
        peer.close()


@pytest.mark.timeout(900)  # a hang guard: seconds on a quiet host, minutes at load 30
def test_bench_decode_peer_llamacpp(tmp_path):
    from moebit.bench import decode

    out = tmp_path / "d.json"
    threads = torch.get_num_threads()
    try:
        assert decode.main(["--configs", "tiny", "--batch", "1", "--prompt", "8",
                            "--new-tokens", "4", "--reps", "1", "--threads", "1",
                            "--variants", "fp32", "int8", "int4", "--no-transformers",
                            "--peer", "llamacpp", "--bandwidth-mb", "64",
                            "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    b1 = json.loads(out.read_text())["configs"]["tiny"]["b1"]
    for peer in ("llamacpp_F32", "llamacpp_Q8_0", "llamacpp_Q4_0"):
        assert b1[peer]["ms_per_step"] > 0 and b1[peer]["x_floor"] > 0
    assert b1["llamacpp_F32"]["agree_with_moebit_fp32"]["first_token"]
    assert b1["moebit_int8"]["tokens_per_s_vs_llamacpp_Q8_0"] > 0
    assert b1["moebit_int4"]["tokens_per_s_vs_llamacpp_Q4_0"] > 0


def test_llamacpp_reads_any_text_as_its_bytes(tiny, tmp_path):
    """The GGUF vocabulary (GPT-2's byte-level BPE alphabet, one merge that yields no
    token) makes llama.cpp's tokenizer the identity on bytes, as moebit's byte
    tokenizer is: spaces, newlines, control bytes, multi-byte UTF-8 and the merged pair."""
    from moebit.bench.decode_llamacpp import open_llama
    from moebit.bench.gguf_convert import write_gguf

    _, model = tiny
    llm = open_llama(write_gguf(model, tmp_path / "f.gguf", "F32"), 1, 64)
    try:
        for text in ("def main():\n    x = 'é'  ~~~ ~ ~~",
                     "".join(chr(i) for i in range(1, 128)), "é中😀 \t\r\n"):
            ids = llm.tokenize(text.encode(), add_bos=False, special=False)
            assert ids == list(text.encode())
            assert llm.detokenize(ids) == text.encode()
    finally:
        llm.close()
