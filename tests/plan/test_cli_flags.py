"""`moebit plan` flags: a 0 is an error naming the flag (never a silent default or a
ZeroDivisionError), the assumed setup is printed, and small models print in K."""

from __future__ import annotations

import json

import pytest

from moebit.cli.plan import main
from moebit.plan.report import count


@pytest.mark.parametrize("flag", ["--steps", "--micro-batch", "--ep-size", "--grad-accum",
                                  "--global-batch", "--freeze-step", "--nodes",
                                  "--devices-per-node"])
def test_a_zero_count_is_an_error_naming_the_flag(flag, capsys):
    assert main(["--model", "bert-large", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"moebit plan: error: {flag} must be >= 1 (got 0)"


def test_a_negative_sequence_length_is_an_error(capsys):
    assert main(["--model", "bert-large", "--seq-len", "-1"]) == 2
    assert "--seq-len must be >= 0" in capsys.readouterr().err


def test_bench_mode_checks_its_counts_too(capsys):
    assert main(["bench", "--nproc", "0", "--calibration", "x.json"]) == 2
    assert "--nproc must be >= 1 (got 0)" in capsys.readouterr().err


def test_the_assumed_setup_is_printed(capsys, tmp_path):
    assert main(["--model", "bert-large", "--cluster", "tang2021-ethernet", "--steps", "500",
                 "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert ("setup: micro-batch 16 sequences per device x grad-accum 1, sequence length 128 "
            "(the model's), 500 steps, 1-bit freeze step 100 (20% of the steps), ep-size 1") in out
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["setup"]["steps"] == 500 and doc["setup"]["micro_batch"] == 16
    assert main(["--model", "bert-large", "--micro-batch", "4", "--seq-len", "64",
                 "--freeze-step", "30"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 4 sequences" in out and "sequence length 64," in out
    assert "freeze step 30," in out


def test_small_models_print_in_k(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("n_layer = 1\nd_model = 16\nn_head = 2\nblock_size = 32\n")
    assert main(["--model", str(cfg), "--nodes", "1", "--devices-per-node", "2"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert "0M" not in title and "K parameters" in title
    assert [count(n) for n in (512, 12_345, 336e6, 1.3e9, 52e9)] == [
        "512", "12.3K", "336M", "1.3B", "52B"]
