"""``moebit bench comm`` end to end on a tiny size: ranks via torchrun, table and JSON."""

from __future__ import annotations

import json

import pytest

from moebit.bench import comm


def test_sizes_and_methods_parse():
    assert comm.parse_size("32M") == 32 << 20
    assert comm.parse_size("4096") == 4096
    assert comm.parse_size("1.5K") == 1536
    args = comm.build_parser().parse_args(["--ranks", "2,4", "--methods", "fp32,onebit"])
    assert args.ranks == [2, 4] and args.methods == ["fp32", "onebit"]
    with pytest.raises(SystemExit):
        comm.build_parser().parse_args(["--methods", "fp64"])
    with pytest.raises(SystemExit):
        comm.build_parser().parse_args(["--sizes", "lots"])


def test_matrix_shape_for_powersgd():
    assert comm._matrix_shape(32 << 20) == (4096, 8192)
    rows, cols = comm._matrix_shape(3 * 1024)
    assert rows * cols == 3 * 1024 and rows <= cols


def test_bench_runs_two_ranks_and_writes_json(tmp_path, capsys):
    out = tmp_path / "comm.json"
    rc = comm.main([
        "--ranks", "2", "--sizes", "65536", "--reps", "2", "--warmup", "1",
        "--methods", ",".join(comm.METHODS), "--json", str(out), "--timeout", "120",
    ])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = {r["method"]: r for r in doc["results"]}
    assert set(rows) == set(comm.METHODS)
    n, w = 65536, 2
    assert rows["fp32"]["speedup_vs_fp32"] == pytest.approx(1.0)
    assert rows["fp32"]["bytes_sent_per_rank"] == 2 * (w - 1) / w * 4 * n
    assert rows["fp16"]["bytes_sent_per_rank"] == 2 * (w - 1) / w * 2 * n
    for m in ("onebit", "onebit-wire", "onebit-ddp"):
        assert 1.0 <= rows[m]["bytes_vs_ideal_1bit"] < 1.01, m
    assert rows["powersgd"]["bytes_sent_per_rank"] > 0
    assert all(r["median_s"] > 0 for r in rows.values())
    printed = capsys.readouterr().out
    assert "onebit-wire" in printed and "x fp32" in printed


def test_link_without_root_stops_with_a_clear_error(monkeypatch, capsys):
    import os

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert comm.main(["--link", "1gbit", "--ranks", "2"]) == 2
    assert "needs root" in capsys.readouterr().err
    assert comm.main(["--link", "fast"]) == 2
    assert "cannot read link rate" in capsys.readouterr().err


def test_cuda_without_a_gpu_stops_before_any_rank(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert comm.main(["--device", "cuda", "--ranks", "2"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert comm.main(["--backend", "nccl", "--ranks", "2"]) == 2
    assert "--backend nccl needs --device cuda" in capsys.readouterr().err
