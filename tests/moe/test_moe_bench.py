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
    # auto measured its candidates in the run and reports each one's time
    tuned = [t for r in results if r["impl"] == "moebit" for t in r.get("auto", {}).values()]
    assert tuned, [r.get("auto") for r in results]
    for t in tuned:
        assert t["choice"] in t["times_ms"] and "loop" in t["times_ms"]
        assert all(v > 0 for v in t["times_ms"].values())


def test_bench_moe_cuda_without_a_gpu_is_a_usage_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench_moe.main(["--device", "cuda"])
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_bench_moe_swiglu_rows_and_ratios(tmp_path: Path) -> None:
    """The SwiGLU rows, their floor and the HF peer (or its skip message) with the ratios."""
    out = tmp_path / "moe.json"
    impls = ("lower_bound_swiglu,moebit_swiglu,moebit_swiglu_loop,moebit_swiglu_padded,"
             "moebit_swiglu_grouped,hf_eager,hf_grouped_mm,lower_bound,moebit,moebit_grouped")
    rc = bench_moe.main(["--experts", "4", "--k", "2", "--dtypes", "float32", "--tokens", "64",
                         "--d-model", "16", "--d-ffn", "32", "--d-ffn-gated", "24", "--reps", "1",
                         "--threads", "1", "--impls", impls, "--timeout", "120",
                         "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["impl"]: r for r in data["results"]}
    for impl in impls.split(","):
        r = rows[impl]
        if impl.startswith("hf_") and "error" in r:
            assert "transformers is not importable" in r["error"]  # optional peer, skipped
            continue
        assert "error" not in r, r
        assert r["fwd_bwd_ms"] > 0 and r["ratio_lower_bound"] > 0
    ratios = data["ratios"][0]
    assert ratios["swiglu_over_floor"] > 0 and ratios["moebit_swiglu_auto_over_best_kernel"] > 0
