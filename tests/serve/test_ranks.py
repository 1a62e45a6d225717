"""``moebit serve --nproc 2 --ep-size 2``: rank 0 serves HTTP, rank 1 serves its experts;
greedy answers equal one process's ``moebit generate``, SIGTERM drains every rank and exits
0, and a dead rank means 503 + exit."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import MOE, Server, save_run

from moebit.inference.generate import generate_tokens
from moebit.inference.loading import load_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("serve_ep_run")
    save_run(d, **MOE)
    return d


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def test_two_ranks_expert_parallel_serve_the_same_text(moe_run: Path) -> None:
    torch.set_num_threads(1)
    prompts = ["def foo(", "import os\n", "x", "class A:\n    "]
    toks = generate_tokens(load_model(moe_run), [list(p.encode()) for p in prompts], 20,
                           temperature=0).tokens
    want = [bytes(t).decode("utf-8", errors="replace") for t in toks]
    with Server(moe_run, "--nproc", "2", "--ep-size", "2", "--max-batch", "2") as s:
        got: dict[int, str] = {}

        def one(i: int) -> None:
            r = httpx.post(s.url + "/v1/completions", timeout=120, json={
                "prompt": prompts[i], "max_tokens": 20, "temperature": 0})
            got[i] = r.json()["choices"][0]["text"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [got.get(i) for i in range(len(prompts))] == want
        load = httpx.get(s.url + "/metrics").text
        assert 'moebit_expert_tokens_total{layer="0",expert="3"}' in load
        # a dead rank: the server stops answering 200 and the launcher exits non-zero
        ranks = sorted(_children(s.proc.pid))
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        try:
            r = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"prompt": "a", "max_tokens": 50})
            assert r.status_code == 503
        except httpx.TransportError:
            pass  # the launcher stopped rank 0 before it could answer
        assert s.proc.wait(timeout=120) != 0


@pytest.fixture(scope="module")
def long_moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MoE model with a long context: a request decodes long enough to signal mid-way."""
    d = tmp_path_factory.mktemp("serve_ep_long_run")
    save_run(d, **{**MOE, "n_layer": 1, "block_size": 2048})
    return d


def test_sigterm_drains_two_expert_parallel_ranks_then_exits_0(long_moe_run: Path) -> None:
    """SIGTERM on the launcher: both streams in flight finish whole, every rank stops, exit 0."""
    s = Server(long_moe_run, "--nproc", "2", "--ep-size", "2", "--max-batch", "2")
    try:
        tails: dict[int, list[str]] = {}
        started = [threading.Event(), threading.Event()]

        def one(i: int, n: int) -> None:
            with httpx.stream("POST", s.url + "/v1/completions", timeout=120, json={
                    "prompt": "ab"[i], "max_tokens": n, "temperature": 0, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                started[i].set()
                tails[i] = [ln for ln in lines if ln]

        threads = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate((600, 300))]
        for t in threads:
            t.start()
        assert all(e.wait(timeout=120) for e in started)
        ranks = _children(s.proc.pid)
        assert len(ranks) == 2, ranks
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=180)
        for i, n in enumerate((600, 300)):
            assert tails[i][-1] == "data: [DONE]", tails[i][-3:]
            last = json.loads(tails[i][-2].removeprefix("data: "))
            assert last["usage"]["completion_tokens"] == n
        assert s.proc.wait(timeout=120) == 0, s.proc.stderr.read()
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)
    finally:
        s.close()
