"""``moebit bench train --peers torchft_diloco``: torchft's DiLoCo beside moebit's on the
same model, data and schedule; settings it cannot run on CPU fail the row with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moebit.bench.torchft_peer import unsupported
from moebit.bench.train import failed_row, format_table, peer_error
from moebit.training.config import TrainConfig

TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--block-size", "32",
        "--batch-size", "2", "--eval-every", "4", "--eval-batches", "1", "--log-every", "2",
        "--threads", "1", "--dtype", "fp32"]


def test_what_torchft_cannot_run_on_cpu_is_one_line_naming_the_flag(tmp_path: Path):
    assert unsupported(TrainConfig(outer="diloco", outer_every=4)) is None
    int8 = unsupported(TrainConfig(outer="diloco", outer_every=4, outer_compress="int8"))
    assert int8 is not None and "--outer-compress int8" in int8 and "Triton" in int8
    frags = unsupported(TrainConfig(outer="streaming_diloco", outer_every=4, outer_fragments=2))
    assert frags is not None and "--outer-fragments" in frags
    assert all("\n" not in r for r in (int8, frags))
    assert peer_error(tmp_path) is None
    (tmp_path / "peer_error.txt").write_text(int8 + "\n")
    assert peer_error(tmp_path) == int8
    rows = [{"optimizer": "diloco", "val_loss": 3.0, "val_loss_vs_first": 1.0, "bytes_sent": 8,
             "bytes_fewer_than_first": 1.0, "tokens_per_s": 10.0, "tokens_per_s_vs_first": 1.0,
             "step_s": 0.1, "comm_s_per_step": 0.0, "comm_share": 0.0},
            failed_row("torchft diloco", tmp_path, int8, 2)]
    table = format_table(rows, None)
    assert table.splitlines()[-2].split()[:3] == ["torchft", "diloco", "failed"]
    assert table.splitlines()[-1] == f"torchft diloco: failed: {int8}"


@pytest.mark.slow
def test_torchft_diloco_runs_beside_moebit_diloco(tmp_path: Path, small_corpus: Path):
    pytest.importorskip("torchft", reason="torchft not installed (pip install 'moebit[torchft]')")
    out = tmp_path / "bench"
    res = subprocess.run([sys.executable, "-m", "moebit.cli", "bench", "train", "--nproc", "2",
                          "--steps", "8", "--measure-from", "4", "--optimizers", "diloco",
                          "--peers", "torchft_diloco", "--out", str(out), "--",
                          "--data", str(small_corpus), *TINY, "--outer-every", "4"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    ours, ft = json.loads((out / "results.json").read_text())["results"]
    assert ft["optimizer"] == "torchft diloco" and "error" not in ft
    assert ft["n_params"] == ours["n_params"]
    # two syncs (steps 4 and 8), each a ring allreduce of every fp32 parameter over 2 ranks
    assert ft["bytes_sent_by_kind"] == {"outer": 2 * 4 * ft["n_params"]}
    assert 0 < ft["val_loss"] < 6.0 and abs(ft["val_loss"] - ours["val_loss"]) < 0.5
    assert "torchft diloco" in res.stdout
