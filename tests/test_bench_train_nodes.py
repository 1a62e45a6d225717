"""``moebit bench train --two-nodes``: rows on two emulated nodes, the bytes that cross
the slow link measured on the veth pair, DiLoCo's outer group across the nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moebit.bench.train import parse, row_flags
from moebit.bench.train_nodes import RDZV_PORT, link_fields, node_argv

can_shape = (
    sys.platform == "linux" and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
)


def test_each_node_runs_half_the_ranks_at_one_rendezvous(tmp_path: Path):
    job = ["python", "-m", "moebit.cli", "train", "--nproc", "4", "--run-dir", str(tmp_path)]
    n0 = node_argv(job, 0, "10.77.0.1", 4, tmp_path)
    n1 = node_argv(job, 1, "10.77.0.1", 4, tmp_path)
    assert n0[-10:] == ["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                        f"10.77.0.1:{RDZV_PORT}", "--rdzv-id", "moebit-bench-train"]
    assert n1[-2:] == ["--run-dir", f"{tmp_path}-node1"] and "--node-rank" in n1
    with pytest.raises(ValueError, match="even --nproc"):
        node_argv(job, 0, "10.77.0.1", 3, tmp_path)
    assert link_fields(tmp_path, 100) == {}
    (tmp_path / "link_bytes.json").write_text(json.dumps(
        {"link": "1gbit", "node0_to_node1": 300, "node1_to_node0": 100}))
    assert link_fields(tmp_path, 100) == {"inter_node_bytes": 400,
                                          "inter_node_bytes_per_token": 4.0,
                                          "inter_node_peak_direction_bytes": 300}
    # an outer row's workers are the nodes unless --outer-group is given
    assert row_flags(["--outer-every", "4"], "diloco", "node")[1][-4:] == [
        "--outer-group", "node", "--outer", "diloco"]
    with pytest.raises(SystemExit):
        parse(["--two-nodes", "--nproc", "4"])  # no --link


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not can_shape, reason="needs root, Linux and iproute2 (ip, tc)")
def test_adam_and_diloco_on_two_emulated_nodes(tmp_path: Path, small_corpus: Path):
    out = tmp_path / "bench"
    res = subprocess.run(
        [sys.executable, "-m", "moebit.cli", "bench", "train", "--two-nodes", "--link", "1gbit",
         "--nproc", "2", "--steps", "8", "--measure-from", "4", "--optimizers", "adam,diloco",
         "--out", str(out), "--", "--data", str(small_corpus), "--n-layer", "1", "--n-head", "2",
         "--d-model", "64", "--block-size", "32", "--batch-size", "2", "--eval-every", "8",
         "--eval-batches", "1", "--log-every", "2", "--threads", "1", "--dtype", "fp32",
         "--outer-every", "4", "--outer-compress", "1bit"],
        capture_output=True, text=True, timeout=800)
    assert res.returncode == 0, res.stderr[-3000:]
    adam, diloco = json.loads((out / "results.json").read_text())["results"]
    for r in (adam, diloco):
        assert r["world_size"] == 2 and r["inter_node_bytes"] > 0
        assert (Path(r["run"] + "-node1") / "config.json").is_file()  # node 1 launched there
        assert not (Path(r["run"] + "-node1") / "metrics.jsonl").exists()  # rank 0 writes them
    cfg = json.loads((out / "diloco" / "config.json").read_text())
    assert cfg["outer_group"] == "node"  # one rank per node: each node is a worker
    # Adam allreduces ~4 x 0.05M floats every step across the link; DiLoCo 1-bit twice
    assert adam["inter_node_bytes"] > 8 * 2 * 4 * adam["n_params"] * 0.9
    assert diloco["inter_node_bytes"] < adam["inter_node_bytes"] / 5
    assert "node-link B/token" in res.stdout
