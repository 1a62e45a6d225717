"""``moebit serve`` over HTTP with a real client: answers equal moebit generate's, streams
equal whole replies, many clients at once, 4xx for bad requests, 429, disconnects, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import MOE, Server, save_run

from moebit.bench.serve_load import load
from moebit.inference.generate import generate_tokens
from moebit.inference.loading import load_model

pytestmark = pytest.mark.timeout(240)
RUN_FLAGS = {k: v for k, v in MOE.items() if k != "block_size"} | {"block_size": 256}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("serve_run")
    save_run(d, **RUN_FLAGS)
    return d


@pytest.fixture(scope="module")
def server(run: Path):
    with Server(run, "--max-batch", "8", "--max-queue", "64", "--prefill-chunk", "16") as s:
        yield s


def _reference(run: Path, prompts: list[str], n: int) -> list[str]:
    torch.set_num_threads(1)
    toks = generate_tokens(load_model(run), [list(p.encode()) for p in prompts], n,
                           temperature=0).tokens
    return [bytes(t).decode("utf-8", errors="replace") for t in toks]


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _stream_text(url: str, **body) -> tuple[str, list[dict]]:
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks


def test_greedy_completion_equals_moebit_generate(server: Server, run: Path) -> None:
    prompts = ["def foo(", "import os\n", "x"]
    want = _reference(run, prompts, 24)
    for p, w in zip(prompts, want, strict=True):
        r = _complete(server.url, prompt=p, max_tokens=24, temperature=0)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == w
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(p.encode()), "completion_tokens": 24,
                                 "total_tokens": len(p.encode()) + 24}


def test_stream_concatenates_to_the_whole_reply(server: Server) -> None:
    for params in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.8, "top_k": 20, "seed": 7}):
        whole = _complete(server.url, prompt="class A:", max_tokens=40, **params).json()
        text, chunks = _stream_text(server.url, prompt="class A:", max_tokens=40, **params)
        assert text == whole["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 40


def test_chat_models_health_metrics(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert r.json()["object"] == "chat.completion"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == 256
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = httpx.get(server.url + "/metrics").text
    for name in ("moebit_requests_total", "moebit_output_tokens_per_second",
                 "moebit_queue_depth", "moebit_time_to_first_token_seconds_bucket",
                 "moebit_inter_token_latency_seconds_count", "moebit_expert_tokens_total"):
        assert name in m


def test_32_concurrent_requests_all_complete(server: Server, run: Path) -> None:
    prompts = [f"{i} " * (1 + i % 7) for i in range(32)]
    lengths = [4 + (i * 5) % 29 for i in range(32)]
    out: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        out[i] = _complete(server.url, prompt=prompts[i], max_tokens=lengths[i], temperature=0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert sorted(out) == list(range(32))
    assert all(r.status_code == 200 for r in out.values())
    ref = _reference(run, prompts[:4], max(lengths[:4]))
    for i in range(4):  # greedy: each is a prefix of its reference, whatever the batch was
        assert out[i].json()["choices"][0]["text"] == ref[i][:len(out[i].json()["choices"][0]["text"])]
        assert out[i].json()["usage"]["completion_tokens"] == lengths[i]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "top_k": -5}, "top_k"),
    ({"prompt": "a", "stop": ["", "x"]}, "stop"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x" * 300}, "prompt"),  # longer than the context (256)
])
def test_bad_requests_get_400_naming_the_field(server: Server, body: dict, param: str) -> None:
    r = _complete(server.url, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_json_gets_400(server: Server) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A long context: one request decodes for seconds, long enough to disconnect from."""
    d = tmp_path_factory.mktemp("serve_long_run")
    save_run(d, n_layer=1, block_size=4096)
    return d


def test_disconnect_frees_the_slot_and_full_queue_gets_429(long_run: Path) -> None:
    with Server(long_run, "--max-batch", "1", "--max-queue", "1") as s:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                "prompt": "a", "max_tokens": 4000, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # the request holds the only slot now
            waiting = threading.Thread(target=lambda: _complete(s.url, prompt="b", max_tokens=2))
            waiting.start()
            for _ in range(100):  # the queue's one place is taken once /metrics says so
                if "moebit_queue_depth 1" in httpx.get(s.url + "/metrics").text:
                    break
                threading.Event().wait(0.05)
            assert _complete(s.url, prompt="c", max_tokens=2).status_code == 429
        # the stream is closed mid-way: its slot goes to the waiting request, then to this one
        waiting.join(timeout=60)
        r2 = _complete(s.url, prompt="d", max_tokens=3, temperature=0)
        assert r2.status_code == 200
        m = httpx.get(s.url + "/metrics").text
        assert 'moebit_requests_total{reason="cancelled"} 1' in m
        assert 'moebit_requests_total{reason="rejected"} 1' in m  # the 429 is counted
        assert "moebit_running_requests 0\n" in m


def test_sigterm_drains_in_flight_requests_then_exits_0(long_run: Path) -> None:
    s = Server(long_run, "--max-batch", "2")
    try:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                "prompt": "a", "max_tokens": 1500, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 1500
        assert s.proc.wait(timeout=60) == 0
    finally:
        s.close()


def test_bench_load_generator_counts_every_token_and_request(server: Server) -> None:
    """The benchmark's cheap client (raw bytes, JSON only for the last chunk) agrees with
    what was asked: every request completed, every token counted, one TTFT per request."""
    jobs = [("def " * (1 + i % 3), 3 + 4 * i) for i in range(6)]
    for stream in (True, False):
        rec = asyncio.run(load(server.url, jobs, clients=3, stream=stream))
        assert (rec["completed"], rec["lost"], rec["5xx"]) == (6, 0, 0)
        assert rec["tokens_per_s"] * rec["wall_s"] == pytest.approx(sum(n for _, n in jobs))
    assert rec["ttft_p50_ms"] is None  # whole replies: no per-token timings
