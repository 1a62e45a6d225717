"""``moebit serve HF_DIR``: a Hugging Face folder served through its own tokenizer."""

from __future__ import annotations

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
from moebit.inference.generate import generate_tokens  # noqa: E402
from moebit.models.hf.tokens import load_tokenizer  # noqa: E402

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hf_serve")
    make_hf_model("qwen2_moe", d, vocab_size=320)
    train_tokenizer(d, vocab_size=320)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return d


def test_greedy_completion_and_chat_on_a_hugging_face_folder(folder: Path) -> None:
    prompt = "def wrap(text, width"
    tok = load_tokenizer(folder)
    torch.set_num_threads(1)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    want = tok.decode(generate_tokens(from_pretrained(folder), [ids], 8, temperature=0).tokens[0])
    with Server(folder, "--context", "64", "--max-batch", "4") as s:
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == want
        assert body["usage"]["prompt_tokens"] == len(ids)
        chat = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] >= 1
