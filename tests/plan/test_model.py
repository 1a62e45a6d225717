"""Schedules, step costs, whole runs, bench-compatible output and the CLI's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebit.cli.plan import main
from moebit.plan.benchmode import bench_predict, compare_rows, parse_train_flags
from moebit.plan.cluster import ClusterSpec, cluster_from_dict, parse_bandwidth, parse_latency
from moebit.plan.model import Setup, compare, predict, schedule, step_costs
from moebit.plan.presets import preset
from moebit.plan.report import plot
from moebit.plan.spec import ModelSpec, SpecError

TINY = ModelSpec("tiny", 2, 64, 4, 256, 256, 32, learned_positions=32)


def test_schedules() -> None:
    s = Setup(steps=10, freeze_step=3)
    assert schedule("adam", s) == ["exact"] * 10
    assert schedule("onebit_adam", s) == ["exact"] * 3 + ["onebit"] * 7
    # 0/1 Adam: var_interval doubles after every 2 refreshes -> refreshes at 1, 2, 4, 6, 8
    z = Setup(steps=12, freeze_step=8, var_update_scaler=2, local_step_scaler=2,
              local_step_clipper=4)
    kinds = schedule("zero_one_adam", z)
    assert kinds[:8] == ["exact", "exact", "onebit", "exact", "onebit", "exact", "onebit",
                         "exact"]
    # stage 2: sync every step for 2 steps, then every 2nd step
    assert kinds[8:] == ["onebit", "onebit", "local", "onebit"]
    with pytest.raises(SpecError, match="setup.optimizer"):
        schedule("sgd", s)


def test_step_costs_by_hand() -> None:
    c = ClusterSpec(nodes=1, devices_per_node=2, intra_bw=1e9, intra_lat=0.0, inter_bw=1e9,
                    inter_lat=0.0, flops=1e12, pack_rate=1e9, update_rate=1e9)
    s = Setup(micro_batch=2, steps=10)
    costs = step_costs(TINY, c, s)
    n = TINY.total_params()
    compute = TINY.train_flops_per_token() * 64 / 1e12 + n / 1e9
    assert costs["exact"].compute == pytest.approx(compute)
    # 2 ranks, fp32: ring allreduce sends 2*(1)/2 * 4n bytes = 4n; 2 steps of 2n bytes / 1 GB/s
    assert costs["exact"].bytes_sent == pytest.approx(4 * n)
    assert costs["exact"].comm == pytest.approx(2 * (2 * n) / 1e9)
    assert costs["onebit"].bytes_sent < costs["exact"].bytes_sent / 20


def test_whole_run_counts_warmup_and_bytes() -> None:
    c = ClusterSpec(nodes=4, devices_per_node=8, inter_bw=1e9)
    s = Setup(micro_batch=4, seq_len=128, steps=100, freeze_step=20)
    rows = compare(preset("bert-large"), c, s, ["adam", "onebit_adam"])
    a, o = rows
    assert o["steps_by_kind"] == {"exact": 20, "onebit": 80, "local": 0}
    assert o["bytes_sent"] == pytest.approx(20 * a["bytes_per_step"]["exact"]
                                            + 80 * o["bytes_per_step"]["onebit"])
    assert o["run_speedup_vs_first"] > 1.0
    assert a["bytes_sent"] / o["bytes_sent"] == pytest.approx(o["bytes_fewer_than_first"])


def test_expert_parallel_all_to_all_appears_with_ep() -> None:
    moe = preset("gpt-350m-moe128")
    c = ClusterSpec(nodes=2, devices_per_node=8)
    no_ep = predict(moe, c, Setup(micro_batch=1, seq_len=512, steps=10, ep_size=1), "adam")
    ep = predict(moe, c, Setup(micro_batch=1, seq_len=512, steps=10, ep_size=8), "adam")
    # with ep=8 each rank holds 1/8 of the experts: far fewer gradient bytes, plus tokens
    assert ep["bytes_per_step"]["exact"] < no_ep["bytes_per_step"]["exact"]


@pytest.mark.parametrize("raw, field", [
    ({"inter_bw": 0}, "cluster.inter_bw"),
    ({"inter_bw": "fast"}, "cluster.inter_bw"),
    ({"nodes": 0}, "cluster.nodes"),
    ({"intra_lat": "-1ms"}, "cluster.intra_lat"),
    ({"flops": -5.0}, "cluster.flops"),
    ({"bogus": 1}, "cluster.bogus"),
])
def test_bad_cluster_names_the_field(raw: dict, field: str) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        cluster_from_dict(raw)


def test_bad_setup_names_the_field() -> None:
    c = ClusterSpec(nodes=1, devices_per_node=6)
    with pytest.raises(SpecError, match=r"setup\.ep_size"):
        predict(preset("gpt-350m-moe128"), c, Setup(ep_size=4), "adam")
    with pytest.raises(SpecError, match=r"setup\.micro_batch"):
        predict(TINY, c, Setup(micro_batch=0), "adam")
    with pytest.raises(SpecError, match=r"setup\.overlap"):
        predict(TINY, c, Setup(overlap=2.0), "adam")


def test_units() -> None:
    assert parse_bandwidth("40gbit", "x") == 5e9
    assert parse_bandwidth("25GB/s", "x") == 25e9
    assert parse_latency("5us", "x") == pytest.approx(5e-6)
    assert parse_latency("1.5ms", "x") == pytest.approx(1.5e-3)


CALIB = {"matmul_flops": 1e11, "pack_rate": 1e8, "update_rate": 1e7, "link_alpha": 1e-4,
         "link_beta": 2e9, "model_step_s": 0.02}
FLAGS = ["--n-layer", "2", "--d-model", "64", "--block-size", "32", "--batch-size", "2",
         "--num-experts", "4", "--ep-size", "2", "--no-moe-residual", "--threads", "1"]


def test_bench_mode_has_bench_train_fields() -> None:
    doc = bench_predict(["adam", "onebit_adam"], 2, 40, "10", 20, "1gbit", FLAGS, CALIB)
    for key in ("link", "nproc", "steps", "measure_from", "extra", "results"):
        assert key in doc
    for r in doc["results"]:
        for key in ("optimizer", "tokens_per_s", "step_s", "comm_s_per_step", "bytes_sent",
                    "world_size", "n_params", "frozen_at", "comm_share", "tokens_per_s_vs_first",
                    "bytes_fewer_than_first", "val_loss"):
            assert key in r
    assert doc["results"][1]["frozen_at"] == 10
    rows = compare_rows(doc, doc)
    assert all(r["step_err"] == 0.0 for r in rows)


def test_train_flags_errors_name_the_flag() -> None:
    assert parse_train_flags(FLAGS).moe.ep_size == 2
    with pytest.raises(SpecError, match="--n-layr"):
        parse_train_flags(["--n-layr", "2"])
    with pytest.raises(SpecError, match="n_layer"):
        parse_train_flags(["--n-layer", "0"])


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    assert main(["--model", "bert-large", "--cluster", "tang2021-ethernet", "--optimizers",
                 "adam,onebit_adam,zero_one_adam", "--micro-batch", "16", "--seq-len", "128",
                 "--steps", "1000", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["optimizer"] for r in doc["results"]] == ["adam", "onebit_adam", "zero_one_adam"]
    assert main(["--model", "bert-large", "--inter-bw", "0gbit"]) == 2
    assert "cluster.inter_bw" in capsys.readouterr().err
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CALIB))
    pred = tmp_path / "pred.json"
    assert main(["bench", "--optimizers", "adam,onebit_adam", "--nproc", "2", "--steps", "20",
                 "--measure-from", "10", "--calibration", str(cal), "--json", str(pred),
                 "--", *FLAGS]) == 0
    assert main(["--validate", str(pred), "--calibration", str(cal)]) == 0
    assert "+0%" in capsys.readouterr().out


def test_plots(tmp_path: Path) -> None:
    files = plot(TINY, ClusterSpec(nodes=2, devices_per_node=4), Setup(steps=50),
                 ["adam", "onebit_adam"], str(tmp_path))
    assert all(Path(f).stat().st_size > 1000 for f in files)
