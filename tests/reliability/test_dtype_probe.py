"""``--dtype auto``: a measured probe of bf16 autocast against fp32, cached per CPU, fp32 as
the fallback; the launcher resolves it once, prints why, and the start record keeps it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moebit.cli.launch import prepare_run_dir, release_run_dir
from moebit.runs import dtype_probe
from moebit.training.config import ConfigError, TrainConfig, build


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache" / "dtype-probe.json"
    monkeypatch.setenv(dtype_probe.ENV_CACHE, str(path))
    return path


def native_bf16() -> bool:
    _, flags = dtype_probe.cpu_identity()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def test_auto_measures_once_then_reads_the_cache(cache: Path):
    first = dtype_probe.resolve("auto", "cpu")
    assert first.requested == "auto" and first.dtype in ("bf16", "fp32")
    assert "measured now, cached in" in first.reason and str(cache) in first.reason
    ratio = first.bf16_over_fp32
    assert ratio is not None and ratio > 0
    # The choice follows the measurement: bf16 only when clearly faster.
    assert first.dtype == ("bf16" if ratio * dtype_probe.MIN_SPEEDUP <= 1 else "fp32")
    if not native_bf16():  # an AVX2-only CPU (this project's test machine) emulates bf16
        assert first.dtype == "fp32" and "slower than fp32" in first.reason
    entry = json.loads(cache.read_text())[dtype_probe.probe_key()]
    assert entry["bf16_over_fp32"] == ratio and entry["cpu"] == dtype_probe.cpu_identity()[0]
    again = dtype_probe.resolve("auto", "cpu")
    assert again.dtype == first.dtype and again.bf16_over_fp32 == ratio
    assert again.reason.startswith("bf16 autocast measured") and "; cached in" in again.reason


def test_the_cached_measurement_decides_both_ways(cache: Path):
    key = dtype_probe.probe_key()
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({key: {"bf16_over_fp32": 0.4}}))
    fast = dtype_probe.resolve("auto", "cpu")
    assert fast.dtype == "bf16" and "2.5x faster than fp32" in fast.reason
    cache.write_text(json.dumps({key: {"bf16_over_fp32": 6.1}}))
    slow = dtype_probe.resolve("auto", "cpu")
    assert slow.dtype == "fp32" and "6.1x slower than fp32 on " in slow.reason
    cache.write_text(json.dumps({key: {"bf16_over_fp32": 0.9}}))  # too close to parity
    assert dtype_probe.resolve("auto", "cpu").dtype == "fp32"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"KEY": {"bf16_over_fp32": "fast"}}',
                                  '{"KEY": {"bf16_over_fp32": -1}}', ""])
def test_a_corrupt_cache_is_measured_again_and_rewritten(cache: Path, text: str):
    cache.parent.mkdir(parents=True)
    cache.write_text(text.replace("KEY", dtype_probe.probe_key()))
    choice = dtype_probe.resolve("auto", "cpu")
    assert "measured now" in choice.reason
    entry = json.loads(cache.read_text())[dtype_probe.probe_key()]
    assert entry["bf16_over_fp32"] == choice.bf16_over_fp32 > 0


def test_the_cache_keys_other_cpus_apart(cache: Path):
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"someothercpu0000": {"bf16_over_fp32": 0.1}}))
    choice = dtype_probe.resolve("auto", "cpu")
    assert "measured now" in choice.reason
    assert set(json.loads(cache.read_text())) == {"someothercpu0000", dtype_probe.probe_key()}


def test_given_dtypes_and_several_nodes_need_no_probe(cache: Path):
    assert dtype_probe.resolve("bf16").dtype == "bf16" and dtype_probe.resolve("fp32").reason == "given"
    multi = dtype_probe.resolve("auto", "cpu", nnodes=2)
    assert multi.dtype == "fp32" and "several nodes" in multi.reason
    assert not cache.exists()
    with pytest.raises(ValueError, match="dtype: must be one of auto, bf16, fp32"):
        dtype_probe.resolve("fp16")


def test_config_defaults_to_auto_and_names_the_key_on_a_bad_value():
    assert TrainConfig().dtype == "auto" and build({}).dtype == "auto"
    assert build({"dtype": "bf16"}).dtype == "bf16"
    with pytest.raises(ConfigError, match=r"dtype: must be auto, bf16 or fp32 \(got 'fp16'\)"):
        build({"dtype": "fp16"})


def test_the_launcher_writes_the_resolved_dtype_and_says_why(tmp_path: Path, cache: Path, capsys):
    cfg = build({"run_dir": str(tmp_path / "run")})
    run = prepare_run_dir(cfg)
    try:
        written = json.loads((run / "config.json").read_text())["dtype"]
        assert written == cfg.dtype and written in ("bf16", "fp32")
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"moebit train: dtype auto -> {written} (bf16 autocast measured ")
        assert str(cache) in line
    finally:
        release_run_dir(run)


def test_start_fields_carry_the_launchers_reason(monkeypatch: pytest.MonkeyPatch):
    choice = dtype_probe.Choice("fp32", "bf16 autocast measured 6.1x slower than fp32 on X, avx2")
    monkeypatch.setenv(dtype_probe.ENV_CHOICE, dtype_probe.to_env(choice))
    assert dtype_probe.start_fields("fp32") == {"dtype": "fp32", "dtype_requested": "auto",
                                                "dtype_reason": choice.reason}
    assert dtype_probe.start_fields("bf16") == {"dtype": "bf16"}  # not this run's choice
    monkeypatch.setenv(dtype_probe.ENV_CHOICE, "{torn")
    assert dtype_probe.start_fields("fp32") == {"dtype": "fp32"}


@pytest.mark.slow
def test_a_real_run_prints_and_records_the_choice(tmp_path: Path, small_corpus: Path, cache: Path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "moebit.cli", "train", "--nproc", "1",
                          "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--block-size", "32",
                          "--batch-size", "2", "--steps", "1", "--samples", "0", "--eval-batches", "1",
                          "--threads", "1", "--data", str(small_corpus), "--run-dir", str(run)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    chosen = json.loads((run / "config.json").read_text())["dtype"]
    assert f"moebit train: dtype auto -> {chosen} (bf16 autocast measured" in out.stderr
    start = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["dtype"] == chosen
    assert start["dtype_requested"] == "auto" and str(cache) in start["dtype_reason"]
