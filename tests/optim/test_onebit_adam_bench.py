"""The freeze-step benchmark runs end to end (tiny settings, in-process) and reports every choice."""

from __future__ import annotations

import json
import os
from pathlib import Path

from moebit.bench import freeze


def test_freeze_benchmark_smoke(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(freeze.__file__).read_text() * 20)
    out = tmp_path / "freeze.json"
    rc = freeze.main([
        "--world", "1", "--steps", "12", "--fractions", "0.25", "--warmup", "2", "--d-model", "16",
        "--n-layer", "1", "--block-size", "16", "--batch-size", "2", "--eval-batches", "2",
        "--data", os.fspath(corpus), "--auto-window", "2", "--auto-min-steps", "4",
        "--auto-threshold", "10", "--timeout", "120", "--out", os.fspath(out),
    ])
    assert rc == 0
    results = {r["choice"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"adam", "0.25", "auto"}
    assert results["adam"]["frozen_at"] is None
    assert results["0.25"]["frozen_at"] == 3
    assert results["auto"]["frozen_at"] == 6  # two quiet checks: steps 4 and 6
    assert results["auto"]["drifts"][0][0] == 4
    assert "auto" in capsys.readouterr().out
