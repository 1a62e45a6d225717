"""``moebit serve --quantize``: a real server on an MoE run with int8 experts and int8
projections answers with the greedy text that the same quantization gives in-process,
and a dense run under ``--quantize-scope experts`` is refused before any rank starts."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import Server, save_run

from moebit.cli import serve as serve_cli
from moebit.inference.generate import generate_tokens
from moebit.inference.loading import load_model
from moebit.inference.quantize_dense import quantize_model_

pytestmark = pytest.mark.timeout(240)


def test_int8_server_answers_the_in_process_int8_greedy_text(tmp_path: Path) -> None:
    run = tmp_path / "moe"
    save_run(run, num_experts=4, moe_every=1, block_size=64)
    torch.set_num_threads(1)
    model = load_model(run)
    quantize_model_(model, 8, "all")
    want = bytes(generate_tokens(model, [list(b"def f(")], 8, temperature=0).tokens[0])
    with Server(run, "--quantize", "int8") as s:
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"prompt": "def f(", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.decode("utf-8", errors="replace")


def test_dense_run_under_experts_scope_is_refused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "dense"
    save_run(run)
    assert serve_cli.main([str(run), "--quantize", "int8", "--quantize-scope", "experts"]) == 2
    assert "holds a dense model" in capsys.readouterr().err
