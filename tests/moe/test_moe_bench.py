"""``moebit bench moe`` end to end at toy sizes: every implementation runs and reports."""

import json
from pathlib import Path

import pytest
import torch

from moebit.bench import moe as bench_moe


def test_bench_moe_reports_every_implementation(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    rc = bench_moe.main(["--experts", "4", "--k", "1,2", "--dtypes", "float32", "--tokens", "64",
                         "--d-model", "16", "--d-ffn", "32", "--reps", "1", "--threads", "1",
                         "--impls", "lower_bound,moebit,moebit_loop,onehot_baseline",
                         "--timeout", "120", "--json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert len(results) == 2 * 4
    for r in results:
        assert "error" not in r, r
        assert r["fwd_bwd_ms"] > 0 and r["fwd_ms"] > 0  # no ordering: one rep on a busy machine
        assert r["ratio_lower_bound"] > 0


def test_bench_moe_cuda_without_a_gpu_is_a_usage_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench_moe.main(["--device", "cuda"])
    assert "no CUDA device is visible" in capsys.readouterr().err
