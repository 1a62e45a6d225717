"""``moebit serve HF_DIR``: a Hugging Face folder served through its own tokenizer, its
``chat_template.jinja``, its BOS for an empty prompt and its generation_config's EOS."""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("transformers", reason="the HF test models need transformers: pip install 'moebit[hf]'")
sys.path.insert(0, str(Path(__file__).parents[1] / "hf"))  # the HF tests' model builders
from hf_models import make_hf_model, train_tokenizer  # noqa: E402
from serve_helpers import Server  # noqa: E402

from moebit.hf import from_pretrained  # noqa: E402
from moebit.inference.generate import eos_token_ids, generate_tokens  # noqa: E402
from moebit.models.hf.tokens import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(240)
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('no system messages here') }}{% endif %}"
            "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPT, EOS_PROMPT = "def wrap(text, width", "    return "
VOCAB = 320


def _greedy(folder: Path, prompt: str, n: int, eos: list[int] | None) -> tuple[list[int], str]:
    torch.set_num_threads(1)
    tok = load_tokenizer(folder)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    res = generate_tokens(from_pretrained(folder), [ids], n, temperature=0, eos=eos)
    return res.tokens[0], res.finish_reasons[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2-MoE with a BPE tokenizer whose last two ids are <s> and </s>, a
    chat_template.jinja, and a generation_config.json whose EOS list holds a token the
    model greedily emits a few tokens into EOS_PROMPT's continuation."""
    from tokenizers import Tokenizer

    d = tmp_path_factory.mktemp("hf_serve")
    make_hf_model("qwen2_moe", d, vocab_size=VOCAB)
    train_tokenizer(d, vocab_size=VOCAB - 2)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(["<s>", "</s>"])
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    main, _ = _greedy(d, PROMPT, 8, eos=[])
    cont, _ = _greedy(d, EOS_PROMPT, 12, eos=[])
    eos = next(t for t in cont[3:] if t not in main and t not in cont[:3])
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos, VOCAB - 1]}))
    return d


@pytest.fixture(scope="module")
def server(folder: Path):
    with Server(folder, "--context", "64", "--max-batch", "4") as s:
        yield s


def test_greedy_completion_and_chat_on_a_hugging_face_folder(folder: Path, server: Server) -> None:
    tok = load_tokenizer(folder)
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    want = tok.decode(_greedy(folder, PROMPT, 8, eos=None)[0])
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == want
    assert body["usage"]["prompt_tokens"] == len(ids)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1


def test_generation_config_eos_stops_generate_and_serve(folder: Path, server: Server) -> None:
    eos = eos_token_ids(from_pretrained(folder).config, folder)
    assert len(eos) == 2 and eos[1] == VOCAB - 1
    toks, reason = _greedy(folder, EOS_PROMPT, 12, eos=eos)
    assert reason == "stop" and toks[-1] == eos[0] and len(toks) < 12
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": EOS_PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == load_tokenizer(folder).decode(toks[:-1])  # EOS is not text
    assert r.json()["usage"]["completion_tokens"] == len(toks)


def test_empty_prompt_starts_from_bos(server: Server) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_template_error_is_a_400_on_a_connection_kept_alive(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        bad = {"messages": [{"role": "system", "content": "x"}], "max_tokens": 2}
        conn.request("POST", "/v1/chat/completions", json.dumps(bad))
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 400 and not r.will_close
        assert err["param"] == "messages" and "no system messages here" in err["message"]
        sock = conn.sock
        good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        conn.request("POST", "/v1/chat/completions", json.dumps(good))
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["object"] == "chat.completion"
        assert conn.sock is sock  # the same connection answered both
    finally:
        conn.close()
