"""The HTTP API's robustness and OpenAI compatibility, on one byte-model server: requests
with extreme numbers fail alone or sample finitely, a fuzz of valid-schema requests never
takes the server down, errors are OpenAI-shaped and name their field, /metrics is right
when idle, JSON is read without a content-type, max_completion_tokens, echo, content
parts, refused logprobs, huge prompts, and the official ``openai`` client."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import Server, save_run

from moebit.cli import serve as serve_cli
from moebit.inference.generate import generate_tokens
from moebit.inference.loading import load_model
from moebit.serve.server import PORT_IN_USE

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("compat_run")
    save_run(d, num_experts=4, moe_every=1, block_size=128)
    return d


@pytest.fixture(scope="module")
def server(run: Path):
    with Server(run, "--max-batch", "4", "--max-queue", "64") as s:
        yield s


def _post(url: str, path: str = "/v1/completions", **body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _greedy(run: Path, prompt: str, n: int) -> str:
    torch.set_num_threads(1)
    toks = generate_tokens(load_model(run), [list(prompt.encode())], n, temperature=0).tokens[0]
    return bytes(toks).decode("utf-8", errors="replace")


def _assert_alive(url: str) -> None:
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    r = _post(url, prompt="ok", max_tokens=2, temperature=0)
    assert r.status_code == 200, r.text


def _openai_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    return err


@pytest.mark.parametrize("body", [
    {"prompt": "def f(x):", "max_tokens": 4, "temperature": 1e-40},
    {"prompt": "a", "max_tokens": 3, "top_p": 1e-300},
    {"prompt": "a", "max_tokens": 3, "temperature": 100, "top_k": 10**9, "seed": 2**64 - 1},
])
def test_extreme_but_valid_numbers_sample_finitely(server: Server, body: dict) -> None:
    """Each of these used to fail the engine: 503 for it, then for every later request."""
    r = _post(server.url, **body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    _assert_alive(server.url)


def _random_body(rng: random.Random) -> dict:
    pick = rng.choice
    body = {"prompt": pick(["", "a", "def f(x):", "\u00e9\u4e2d\U0001F600", "\ud800", "x" * 200,
                            "\n\n", "0" * 127]),
            "max_tokens": rng.randint(1, 4),
            "temperature": pick([0, 1e-40, 5e-324, 1e-6, 0.7, 1.0, 100]),
            "top_p": pick([1e-300, 5e-324, 0.1, 0.9, 1.0]),
            "top_k": pick([-1, 0, 1, 3, 10**9]),
            "seed": pick([None, 0, 7, -(2**63), 2**64 - 1, 2**70]),
            "stop": pick([None, "a", ["\n", "0"], ["x"] * 4]),
            "stream": rng.random() < 0.4}
    if rng.random() < 0.3:
        body["max_completion_tokens"] = rng.randint(1, 4)
    return body


def test_fuzz_valid_schema_requests_never_take_the_server_down(server: Server) -> None:
    rng = random.Random(1234)
    for i in range(40):
        body = _random_body(rng)
        chat = rng.random() < 0.3
        if chat:
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        path = "/v1/chat/completions" if chat else "/v1/completions"
        raw_body = json.dumps(body).encode()  # ASCII escapes: a lone surrogate travels too
        with httpx.stream("POST", server.url + path, content=raw_body, timeout=60,
                          headers={"content-type": "application/json"}) as r:
            raw = r.read()
        assert r.status_code in (200, 400), (i, body, r.status_code, raw[:300])
        if r.status_code == 400:
            assert json.loads(raw)["error"]["param"] in ("seed", "prompt", "messages"), body
        elif body["stream"]:
            assert raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw, body
        else:
            assert json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length"), body
    _assert_alive(server.url)
    m = httpx.get(server.url + "/metrics").text
    assert "moebit_running_requests 0\n" in m and "moebit_queue_depth 0\n" in m
    assert 'reason="error"' not in m


@pytest.mark.parametrize(("raw", "param", "words"), [
    (b'{"prompt": "a", "seed": 1180591620717411303424}', "seed", "seed must be an integer"),
    (b'{"prompt": "a", "temperature": NaN}', "temperature", "finite number"),
    (b'{"prompt": "a", "top_p": Infinity}', "top_p", "finite number"),
    (b'{"prompt": "a", "logprobs": 2}', "logprobs", "not supported"),
    (b'{"prompt": "a", "frequency_penalty": 0.5}', "frequency_penalty", "not supported"),
    (b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true}', "logprobs", "not supported"),
])
def test_bad_values_are_400_naming_the_field(server: Server, raw: bytes, param: str,
                                             words: str) -> None:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
    err = _openai_error(r, 400, param)
    assert words in err["message"] and err["code"] != "context_length_exceeded"
    assert err["type"] == "invalid_request_error"


def test_404_405_and_json_without_a_content_type(server: Server, run: Path) -> None:
    _openai_error(httpx.get(server.url + "/v1/nowhere"), 404, None)
    _openai_error(httpx.get(server.url + "/v1/completions"), 405, None)
    body = json.dumps({"prompt": "def ", "max_tokens": 5, "temperature": 0}).encode()
    want = _greedy(run, "def ", 5)
    for headers in ({}, {"content-type": "application/x-www-form-urlencoded"}):  # curl -d
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want


def test_metrics_after_requests_show_nothing_running(server: Server) -> None:
    for _ in range(2):
        assert _post(server.url, prompt="ab", max_tokens=3).status_code == 200
        m = httpx.get(server.url + "/metrics").text
        assert "moebit_running_requests 0\n" in m and "moebit_queue_depth 0\n" in m


def test_max_completion_tokens_echo_and_content_parts(server: Server, run: Path) -> None:
    r = _post(server.url, prompt="x = ", max_tokens=20, max_completion_tokens=6, temperature=0)
    assert r.json()["usage"]["completion_tokens"] == 6
    text = _greedy(run, "x = ", 6)
    echo = _post(server.url, prompt="x = ", max_tokens=6, temperature=0, echo=True).json()
    assert echo["choices"][0]["text"] == "x = " + text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": "x = ", "max_tokens": 6, "temperature": 0, "echo": True,
            "stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln and ln != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "x = " + text
    msgs = {"plain": [{"role": "user", "content": "hi\nthere"}],
            "parts": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                   {"type": "text", "text": "there"}]}]}
    got = {k: _post(server.url, "/v1/chat/completions", messages=m, max_tokens=6,
                    temperature=0).json()["choices"][0]["message"]["content"]
           for k, m in msgs.items()}
    assert got["plain"] == got["parts"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    err = _openai_error(_post(server.url, "/v1/chat/completions", messages=image), 400, "messages")
    assert "image_url" in err["message"]


def test_huge_prompt_is_refused_by_its_bytes(server: Server) -> None:
    r = _post(server.url, prompt="y" * (4 << 20), max_tokens=1)
    err = _openai_error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "bytes" in err["message"]
    # one byte is one token here: the bound is exact, at most block_size - 1 = 127
    assert _post(server.url, prompt="y" * 127, max_tokens=1).status_code == 200
    r = _post(server.url, prompt="y" * 128, max_tokens=1)
    assert _openai_error(r, 400, "prompt")["code"] == "context_length_exceeded"
    _assert_alive(server.url)


def test_official_openai_client_streamed_and_not(server: Server, run: Path) -> None:
    openai = pytest.importorskip("openai", reason="needs the OpenAI client: pip install 'moebit[openai]'")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    want = _greedy(run, "def g(", 8)
    c = client.completions.create(model=model, prompt="def g(", max_tokens=8, temperature=0)
    assert c.choices[0].text == want and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 8
    parts = [ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="def g(", max_tokens=8, temperature=0, stream=True)]
    assert "".join(parts) == want
    msgs = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=6,
                                           temperature=0, seed=3)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 6
    streamed = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=6,
                                              temperature=0, seed=3, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == \
        whole.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="a", max_tokens=2, logprobs=1)
    assert e.value.body["param"] == "logprobs"


def test_port_in_use_is_one_line_and_exit_2(run: Path, capsys: pytest.CaptureFixture) -> None:
    """Checked before any model is loaded or rank started (``moebit serve`` in-process)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = serve_cli.main([str(run), "--port", str(port)])
    assert code == PORT_IN_USE == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "http://" not in lines[0]
