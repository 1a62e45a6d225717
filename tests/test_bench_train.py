"""``moebit bench train``: the EP no-communication limit, the DDP peers, time to target."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moebit.bench.train import format_table, limit_extra, time_to_target

can_shape = (
    sys.platform == "linux" and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
)

TINY = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--block-size", "32",
        "--batch-size", "2", "--eval-every", "4", "--eval-batches", "1", "--log-every", "2",
        "--threads", "1", "--dtype", "fp32"]


def test_the_ep_limit_runs_the_local_experts_without_expert_parallelism() -> None:
    extra = ["--num-experts", "16", "--ep-size", "4", "--d-model", "64"]
    assert limit_extra(extra) == ["--d-model", "64", "--num-experts", "4"]
    assert limit_extra(["--num-experts=8,16", "--ep-size=2"]) == ["--num-experts", "4,8"]
    assert limit_extra(["--ep-size", "1", "--num-experts", "4"]) == ["--ep-size", "1",
                                                                      "--num-experts", "4"]
    with pytest.raises(ValueError, match="--num-experts"):
        limit_extra(["--ep-size", "2"])
    with pytest.raises(ValueError, match="not divisible"):
        limit_extra(["--ep-size", "4", "--num-experts", "6"])
    with pytest.raises(ValueError, match="k = 2"):
        limit_extra(["--ep-size", "4", "--num-experts", "4", "--num-experts-per-tok", "2"])


def test_time_to_target_is_the_first_evaluation_at_or_below_it() -> None:
    recs = [{"kind": "eval", "val_loss": 3.0, "wall": 1.0}, {"kind": "train", "wall": 1.5},
            {"kind": "eval", "val_loss": 2.0, "wall": 2.0},
            {"kind": "eval", "val_loss": 1.9, "wall": 3.0}]
    assert time_to_target(recs, 2.0) == 2.0
    assert time_to_target(recs, 1.0) is None and time_to_target(recs, None) is None


def _bench(tmp: Path, corpus: Path, *flags: str, train: tuple[str, ...] = ()) -> dict:
    out = tmp / "bench"
    res = subprocess.run([sys.executable, "-m", "moebit.cli", "bench", "train", "--nproc", "2",
                          "--out", str(out), *flags, "--", "--data", str(corpus), *TINY, *train],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "results.json").read_text()) | {"table": res.stdout}


@pytest.mark.slow
def test_limit_for_an_expert_parallel_run(tmp_path: Path, small_corpus: Path) -> None:
    got = _bench(tmp_path, small_corpus, "--optimizers", "adam", "--steps", "6",
                 "--measure-from", "2", "--limit", "--a2a-dtypes", "int8",
                 train=("--num-experts", "4", "--ep-size", "2"))
    ep, limit = got["results"]
    assert ep["optimizer"] == "adam a2a=int8" and ep["a2a_s_per_step"] > 0
    assert limit["optimizer"].startswith("no communication") and limit["bytes_sent"] == 0
    cfg = json.loads((tmp_path / "bench" / "nocomm-0" / "config.json").read_text())
    assert (cfg["num_experts"], cfg["ep_size"]) == (2, 1)


@pytest.mark.slow
def test_peers_powersgd_and_fp16_rows_with_time_to_target(tmp_path: Path,
                                                          small_corpus: Path) -> None:
    got = _bench(tmp_path, small_corpus, "--optimizers", "adam", "--peers", "powersgd,fp16",
                 "--powersgd-rank", "2", "--freeze-step", "2", "--steps", "8",
                 "--measure-from", "4", "--target-loss", "9")
    names = [r["optimizer"] for r in got["results"]]
    assert names == ["adam", "ddp powersgd r=2", "ddp fp16 hook"]
    assert "powersgd" in got["table"] and "fp16" in got["table"] and "s to val 9" in got["table"]
    adam, psgd, fp16 = got["results"]
    assert all(r["time_to_target_s"] is not None for r in got["results"])
    # after PowerSGD starts (step 2) a rank-2 factorisation moves far fewer bytes than fp16
    assert psgd["step_bytes_by_kind"]["ddp_hook"] < fp16["step_bytes_by_kind"]["ddp_hook"]
    assert fp16["step_bytes_by_kind"]["ddp_hook"] < adam["step_bytes_by_kind"]["exact"]
    assert format_table(got["results"], None, 9.0).count("\n") == 5


@pytest.mark.slow
def test_bench_a2a_measures_each_wire_format(tmp_path: Path) -> None:
    out = tmp_path / "a2a.json"
    res = subprocess.run([sys.executable, "-m", "moebit.cli", "bench", "a2a", "--nproc", "2",
                          "--experts", "4", "--tokens", "32", "--d-model", "64", "--reps", "1",
                          "--warmup", "0", "--dtypes", "fp32,int8", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())["results"]
    assert got["int8"]["MB_sent_per_step_rank0"] * 64 * 4 == pytest.approx(
        got["fp32"]["MB_sent_per_step_rank0"] * (64 + 4))
    assert all(r["s_per_step"] > 0 for r in got.values()) and "int8" in res.stdout


@pytest.mark.slow
@pytest.mark.skipif(not can_shape, reason="needs root, Linux and iproute2 (ip, tc)")
def test_bench_a2a_on_two_emulated_nodes(tmp_path: Path) -> None:
    out = tmp_path / "two.json"
    bench = subprocess.Popen([sys.executable, "-m", "moebit.cli", "bench", "a2a", "--two-nodes",
                              "--link", "1gbit", "--nproc", "4", "--experts", "4", "--tokens",
                              "32", "--d-model", "32", "--reps", "1", "--warmup", "0",
                              "--dtypes", "fp32", "--json", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = bench.communicate(timeout=300)
    assert bench.returncode == 0, err[-3000:]
    got = json.loads(out.read_text())["results"]
    assert set(got) == {"fp32", "fp32 hierarchical"}
    # the bench's namespaces are moebit-n<node>-<its pid><4 hex digits>
    left = [p.name for p in Path("/etc/netns").glob(f"moebit-n*-{bench.pid}*")
            if len(p.name.rsplit("-", 1)[1]) == len(str(bench.pid)) + 4]
    assert not left, f"namespaces left behind: {left}"
