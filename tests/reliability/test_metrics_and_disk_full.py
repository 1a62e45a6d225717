"""Issue 21 item 3: a torn metrics line no longer blocks a resume, metrics lines are written
whole, and a checkpoint save on a full disk is one clear error that keeps the previous one."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from moebit.checkpoint import CheckpointError, latest, list_complete, read_manifest, verify
from moebit.comm.collectives import DistInfo
from moebit.models.gpt import GPT
from moebit.runs import metrics
from moebit.runs.metrics import MetricsWriter
from moebit.training import state as ckpt_io
from moebit.training.config import build
from moebit.training.data import TrainBatches
from moebit.training.setup import make_optimizer, param_groups


def test_torn_last_line_is_dropped_on_resume_with_a_warning(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as log:
        for step in (10, 20, 30):
            log.emit({"kind": "train", "step": step})
    with open(path, "a") as f:
        f.write('{"kind": "eval", "st')  # what ENOSPC left behind
    with pytest.warns(UserWarning, match=f"{path}: dropped a torn last line"):
        ckpt_io.trim_metrics(path, 20)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [10, 20]


def test_damage_before_the_last_line_is_an_error_naming_file_and_line(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(metrics.MetricsError, match=f"{path}:2: not a JSON line"):
        metrics.read(path)


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A 1 MiB tmpfs (root only): a disk that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def fill(mnt: Path, leave: int) -> None:
    """Fill the filesystem until about ``leave`` bytes are free."""
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    (mnt / "filler").write_bytes(b"\0" * max(0, free - leave))


def test_metrics_writer_on_a_full_disk_leaves_whole_lines(tiny_fs: Path):
    path = tiny_fs / "metrics.jsonl"
    log = MetricsWriter(path)
    log.emit({"kind": "start"})
    fill(tiny_fs, 0)
    with pytest.raises(OSError, match="metrics.jsonl"):
        for _ in range(10_000):
            log.emit({"kind": "train", "pad": "x" * 500})
    log.close()
    text = path.read_text()
    assert text.endswith("\n")
    [json.loads(line) for line in text.splitlines()]  # every line whole


def test_checkpoint_save_on_a_full_disk_keeps_the_previous_one(tiny_fs: Path, small_corpus: Path):
    cfg = build({"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32, "batch_size": 4,
                 "steps": 4, "dtype": "fp32", "keep_checkpoints": 2})
    model = GPT(cfg.model_config())
    opt = make_optimizer(cfg, param_groups(model, cfg))
    batches = TrainBatches(torch.zeros(1000, dtype=torch.uint8).numpy(), 32, 4, 0, 0)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    run = tiny_fs / "run"
    first = ckpt_io.save(run, 2, model, opt, batches, info, cfg, wall=0.0, train_time=0.0)
    size = sum(f.stat().st_size for f in first.iterdir())
    fill(tiny_fs, size // 2)
    with pytest.raises(CheckpointError) as e:
        ckpt_io.save(run, 4, model, opt, batches, info, cfg, wall=0.0, train_time=0.0)
    msg = str(e.value)
    assert "No space left on device" in msg and "step-00000004" in msg
    assert f"the previous checkpoint {first} is intact" in msg and "\n" not in msg
    assert not (run / "checkpoints" / "step-00000004").exists(), "the partial folder is removed"
    assert latest(run) == first and list_complete(run) == [first]
    verify(first, read_manifest(first))
