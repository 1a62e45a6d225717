"""Issue 21 items 2, 6, 8, 10 and issue 14's corrupt-checkpoint defect: every bad input is
one line from the launcher, before any rank starts and before the run folder exists."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from moebit.cli import main as cli
from moebit.cli.launch import prepare_run_dir, release_run_dir, set_aside_newer
from moebit.cli.train import check_training, parse_train_args

from .conftest import make_run

SMALL = ["--nproc", "2", "--n-layer", "2", "--n-head", "2", "--d-model", "32",
         "--block-size", "32", "--batch-size", "4", "--steps", "2", "--samples", "0"]


def one_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI; it must fail with exit code 2 and exactly one error line, no traceback."""
    rc = cli(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("flags, expected", [
    (["--num-experts", "3", "--ep-size", "2"], "not divisible by ep_size"),
    (["--num-experts", "2", "--num-experts-per-tok", "3"], "larger than num_experts"),
    (["--num-experts", "6", "--ep-size", "3"], "does not divide the world size 2"),
    (["--nproc", "0"], "--nproc must be >= 1"),
    (["--lr", "inf"], "lr: expected a finite number"),
    (["--lr", "-1e-3"], "lr: must be positive"),
])
def test_bad_settings_are_one_line_and_leave_no_folder(tmp_path: Path, small_corpus: Path,
                                                       capsys, flags, expected):
    run = tmp_path / "run"
    line = one_error(capsys, ["train", *SMALL, "--data", str(small_corpus), "--run-dir", str(run),
                              *flags])
    assert expected in line
    assert not run.exists(), "nothing may be written for a run that cannot start"


def test_corpus_smaller_than_the_block_size(tmp_path: Path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("print('hello')\n" * 6)
    line = one_error(capsys, ["train", *SMALL, "--data", str(tiny), "--run-dir", str(tmp_path / "r")])
    assert "fewer than block_size+1 = 33" in line and not (tmp_path / "r").exists()


def test_cuda_without_cuda_is_refused(tmp_path: Path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    line = one_error(capsys, ["train", *SMALL, "--device", "cuda", "--run-dir", str(tmp_path / "r")])
    assert "CUDA is not available" in line and not (tmp_path / "r").exists()


def test_far_more_ranks_than_cores_needs_force(tmp_path: Path, capsys):
    if (os.cpu_count() or 1) * 2 >= 64:
        pytest.skip("this machine has enough cores for 64 ranks")
    line = one_error(capsys, ["train", *SMALL, "--nproc", "64", "--run-dir", str(tmp_path / "r")])
    assert "--force" in line and not (tmp_path / "r").exists()


def test_unwritable_run_dir(tmp_path: Path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_error(capsys, ["train", *SMALL, "--run-dir", str(blocker / "run")])
    assert "not writable" in line and "is a file" in line
    if os.geteuid() != 0:
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        line = one_error(capsys, ["train", *SMALL, "--run-dir", str(ro / "run")])
        assert "read-only filesystem" in line
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("flags, expected", [
    (["--n-layer", "3"], "holds another model"),
    # The run's 2 experts cannot split over 3 ranks: the config refuses it, naming ep_size.
    (["--ep-size", "3"], "not divisible by ep_size = 3"),
])
def test_failed_override_resume_leaves_config_unchanged(tmp_path: Path, small_corpus: Path, capsys,
                                                        flags, expected):
    run = tmp_path / "run"
    make_run(run, small_corpus, n_layer=2, num_experts=2)
    before = (run / "config.json").read_bytes()
    line = one_error(capsys, ["train", "--resume", str(run), "--nproc", "2", *flags])
    assert expected in line
    assert (run / "config.json").read_bytes() == before
    assert not (run / "attempts").exists()
    cfg, launch = parse_train_args(["--resume", str(run), "--nproc", "2"])  # still resumable
    assert check_training(cfg, launch).name == "step-00000004"


def test_corrupt_newest_checkpoint_names_the_file_and_the_intact_one(finished_run: Path, capsys):
    shard = finished_run / "checkpoints" / "step-00000004" / "rank-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    line = one_error(capsys, ["train", "--resume", str(finished_run), "--nproc", "2"])
    good = finished_run / "checkpoints" / "step-00000002"
    assert str(shard) in line and "corrupted" in line
    assert f"moebit train --resume {good}" in line
    assert "Resume with: moebit train --resume " + str(finished_run) not in line


def test_resume_from_a_named_checkpoint_sets_newer_ones_aside(finished_run: Path):
    chosen = finished_run / "checkpoints" / "step-00000002"
    cfg, launch = parse_train_args(["--resume", str(chosen), "--nproc", "2"])
    assert cfg.run_dir == str(finished_run) and launch["resume_from"] == chosen
    assert check_training(cfg, launch) == chosen
    run_dir = prepare_run_dir(cfg)
    try:
        moved = set_aside_newer(run_dir, chosen)
    finally:
        release_run_dir(run_dir)
    assert [m.name.startswith("discarded-step-00000004") for m in moved] == [True]
    assert sorted(p.name for p in (finished_run / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert (finished_run / "attempts" / "1" / "config.json").is_file()


def test_generate_messages(finished_run: Path, tmp_path: Path, capsys):
    line = one_error(capsys, ["generate", str(finished_run), "--prompt", "a", "--temperature", "nan"])
    assert "--temperature must be a finite number" in line
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    line = one_error(capsys, ["generate", str(finished_run), "--prompts-file", str(empty)])
    assert "holds no prompts" in line
    rc = cli(["generate", str(finished_run), "--prompt", "x" * 100, "--max-new-tokens", "200",
              "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "cut to their last 31 bytes" in err and "--max-new-tokens 200" in err


def test_report_bad_out_and_eval_per_run(finished_run: Path, tmp_path: Path, capsys):
    line = one_error(capsys, ["report", str(finished_run), "--out", "/proc/nope"])
    assert "/proc/nope" in line
    rc = cli(["eval", str(finished_run), str(tmp_path / "missing"), "--batches", "1"])
    out = capsys.readouterr()
    assert rc == 2
    assert str(finished_run) in out.out, "the good run's result is kept"
    assert str(tmp_path / "missing") in out.err


def test_torn_metrics_line_is_dropped_by_report(finished_run: Path, capsys):
    with open(finished_run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    with pytest.warns(UserWarning, match="metrics.jsonl: dropped a torn last line"):
        assert cli(["report", str(finished_run)]) == 0
    json.loads((finished_run / "config.json").read_text())
