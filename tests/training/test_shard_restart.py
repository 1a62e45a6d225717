"""``--max-restarts`` under ``--shard fsdp``: a rank killed after the first DCP
checkpoint, torchrun restarts the ranks, they load the checkpoint and the run finishes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launches import restart_after_a_kill, restart_args, start


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_max_restarts_resumes_a_sharded_run_from_its_dcp_checkpoint(tmp_path: Path,
                                                                    small_corpus: Path) -> None:
    run = tmp_path / "run"
    args = [*restart_args(small_corpus, run, 200, 10), "--shard", "fsdp", "--rs-compress", "int8"]
    recs = restart_after_a_kill(start("train", args, run), timeout=400, wait=300)
    resumes = [r for r in recs if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] % 10 == 0 and not resumes[0]["resharded"]
    assert recs[-1]["kind"] == "end" and recs[-1]["steps"] == 200 and recs[-1]["shard"] == "fsdp"
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "no step logged twice"
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert json.loads((newest / "manifest.json").read_text())["kind"] == "dcp"
