"""Kernels chosen by measurement: the fastest candidate wins and is cached per machine, the
cache key follows the ISA, a corrupt cache is rebuilt, and Experts' auto uses it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from moebit.comm import _native
from moebit.moe import autotune
from moebit.moe.experts import Experts


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """Tuning on, with a fresh cache file and nothing remembered in memory."""
    monkeypatch.setenv("MOEBIT_AUTOTUNE", "1")
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("MOEBIT_AUTOTUNE_CACHE", str(path))
    autotune.reset()
    yield path
    autotune.reset()


def _sleepers(calls: dict[str, int]) -> dict:
    def make(name: str, seconds: float):
        def run() -> None:
            calls[name] = calls.get(name, 0) + 1
            time.sleep(seconds)
        return run
    return {"slow": make("slow", 0.02), "fast": make("fast", 0.001)}


def test_the_fastest_candidate_is_chosen_cached_and_not_measured_again(tuning):
    calls: dict[str, int] = {}
    tuned = autotune.choose("p1", _sleepers(calls), default="slow")
    assert tuned.choice == "fast" and tuned.measured
    assert set(tuned.times) == {"slow", "fast"} and tuned.times["slow"] > tuned.times["fast"]
    assert calls == {"slow": autotune.REPS + 1, "fast": autotune.REPS + 1}
    data = json.loads(tuning.read_text())
    entry = data[autotune.machine_key()]["p1"]
    assert entry["choice"] == "fast" and set(entry["times_s"]) == {"slow", "fast"}
    # remembered in memory, then (after reset) read back from the file: no new runs
    assert autotune.choose("p1", _sleepers(calls), default="slow").choice == "fast"
    autotune.reset()
    again = autotune.choose("p1", _sleepers(calls), default="slow")
    assert again.choice == "fast" and not again.measured
    assert calls == {"slow": autotune.REPS + 1, "fast": autotune.REPS + 1}


def test_tuning_off_returns_the_default_without_running_anything(tuning, monkeypatch):
    monkeypatch.setenv("MOEBIT_AUTOTUNE", "0")
    calls: dict[str, int] = {}
    assert autotune.choose("p2", _sleepers(calls), default="slow").choice == "slow"
    assert calls == {} and not tuning.exists()
    with pytest.raises(ValueError, match="default 'none'"):
        autotune.choose("p2", _sleepers(calls), default="none")


def test_a_corrupt_cache_is_set_aside_and_rebuilt(tuning):
    tuning.write_text("{not json")
    calls: dict[str, int] = {}
    with pytest.warns(RuntimeWarning, match="unreadable"):
        tuned = autotune.choose("p3", _sleepers(calls), default="slow")
    assert tuned.choice == "fast" and tuned.measured
    assert json.loads(tuning.read_text())[autotune.machine_key()]["p3"]["choice"] == "fast"
    assert (tuning.parent / "autotune.json.corrupt").read_text() == "{not json"
    tuning.write_text(json.dumps({"machine": ["not", "a", "dict"]}))  # parses, wrong shape
    autotune.reset()
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert autotune.choose("p3", _sleepers(calls), default="slow").measured


def test_the_cache_key_changes_with_the_isa_and_other_machines_entries_are_ignored(
        tuning, monkeypatch):
    monkeypatch.delenv("MOEBIT_ISA", raising=False)
    best = autotune.machine_key()
    assert _native.cpu_model() in best and torch.__version__ in best
    monkeypatch.setenv("MOEBIT_NATIVE", "0")
    assert autotune.machine_key() != best  # no native kernels: another code path
    monkeypatch.delenv("MOEBIT_NATIVE")
    if _native.supported_isas()[-1] != "portable":
        monkeypatch.setenv("MOEBIT_ISA", "portable")
        assert autotune.machine_key() != best and "isa=portable" in autotune.machine_key()
    # an entry written for another machine is not this machine's choice
    tuning.write_text(json.dumps({"Other CPU|isa=avx512|torch=0": {"p4": {"choice": "slow"}}}))
    assert autotune.cached("p4") is None


def test_rows_bucket_rounds_up_to_powers_of_two():
    assert [autotune.rows_bucket(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [0, 1, 2, 4, 4, 8,
                                                                              16, 32]


@pytest.mark.parametrize("train", [False, True])
def test_experts_auto_picks_a_measured_candidate_and_caches_it(tuning, train):
    torch.manual_seed(0)
    ex = Experts(4, 16, 32, expert_type="swiglu")
    counts = [6, 5, 6, 6]  # near-equal blocks: padded is a candidate
    x = torch.randn(sum(counts), 16, requires_grad=train)
    with torch.set_grad_enabled(train):
        y = ex(x, counts)
        tuned = ex.last_tuned
        assert tuned is not None and tuned.measured
        cands = ex.candidates(counts)
        assert tuned.choice in cands and set(tuned.times) == set(cands)
        assert "padded" in cands
        key = ex.tune_key(counts, torch.float32, torch.get_num_threads(), train)
        assert ("train" if train else "infer") in key
        entry = json.loads(tuning.read_text())[autotune.machine_key()][key]
        assert entry["choice"] == tuned.choice
        assert ex.choose_kernel(counts, train=train) == tuned.choice
        # the next call with blocks in the same buckets reuses the choice
        ex.last_tuned = None
        ex(x, counts)
        assert ex.last_tuned is None
    ex.kernel = "loop"
    with torch.set_grad_enabled(train):
        ref = ex(x, counts)
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    if train:  # measuring did not leave gradients behind on the parameters
        assert ex.gate_up_proj.grad is None and x.grad is None
