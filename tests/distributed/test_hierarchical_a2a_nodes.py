"""The hierarchical token all-to-all across two torchrun launchers (two "nodes" of 2 ranks).

Two launchers with ``--nnodes 2 --nproc 2`` give LOCAL_WORLD_SIZE 2, so an ep group of 4
spans both nodes and the exchange runs in two stages. The rows arrive in the same order
as with the flat exchange, so the run must match a flat 4-rank run loss for loss.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moebit.testing import free_port

from launches import run_two_nodes

COMMON = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--block-size", "32",
          "--batch-size", "2", "--steps", "6", "--log-every", "2", "--eval-every", "6",
          "--eval-batches", "1", "--samples", "0", "--dtype", "fp32", "--num-experts", "4",
          "--num-experts-per-tok", "2", "--ep-size", "4", "--threads", "1",
          "--a2a-dtype", "int8", "--a2a-grad-dtype", "bf16"]


def _train_records(run: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "train"]


def _launch(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moebit.cli", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.slow
def test_two_node_hierarchical_run_equals_the_flat_run(tmp_path: Path, small_corpus: Path):
    data = ["--data", str(small_corpus)]
    flat = _launch([*COMMON, *data, "--nproc", "4", "--run-dir", str(tmp_path / "flat")])
    out = flat.communicate(timeout=300)[0]
    assert flat.returncode == 0, out[-3000:]

    port = free_port()
    multi = ["--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"hier{port}", "--a2a-hierarchical", *COMMON, *data]
    run_two_nodes(multi, tmp_path, port, timeout=300)
    hier = next(tmp_path / f"node{i}" for i in range(2)
                if (tmp_path / f"node{i}" / "metrics.jsonl").exists())
    a, b = _train_records(tmp_path / "flat"), _train_records(hier)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    # two stages plus the split-size gather: more (smaller-world) collectives per step
    assert b[-1]["collectives"] > a[-1]["collectives"]
