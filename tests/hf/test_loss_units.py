"""A run trained --init-from a folder with a tokenizer reports its loss per token of that
tokenizer, with bits per byte of the validation text beside it: the train loop's summary
line, `moebit eval` and `moebit report` agree."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from folder_helpers import hf_folder
from hf_models import text_corpus

from moebit.runs.units import bits_per_byte, loss_text, loss_unit
from moebit.testing import run_on_ranks
from moebit.training.loop import summary_line

pytest.importorskip("transformers")


def _train(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.config import build
    from moebit.training.loop import train

    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def test_units_of_bytes_and_tokens():
    assert loss_text(1.0, loss_unit(100, 100, None)) == "1.0000 nats/byte (1.443 bits/byte)"
    tok = loss_unit(1000, 250, "hf/tokenizer.json")
    assert tok == {"loss_unit": "token", "tokenizer": "hf/tokenizer.json", "tokens_per_byte": 0.25}
    assert bits_per_byte(2.0, tok) == pytest.approx(0.5 / math.log(2))
    assert loss_text(2.0, tok) == "2.0000 nats/token of hf/tokenizer.json (0.721 bits/byte)"
    assert bits_per_byte(2.0, {"loss_unit": "token"}) is None  # tokens per byte unknown
    line = summary_line({"steps": 3, "val_loss": 2.0, "n_params": 12_000, "tokens_per_s": 5.0,
                         "bytes_sent": 0, "train_time": 1.0, **tok})
    assert "val loss 2.0000 nats/token of hf/tokenizer.json (0.721 bits/byte)" in line
    assert "nats/byte" not in line


def test_train_eval_and_report_name_the_same_unit(tmp_path, monkeypatch, capsys):
    from moebit.cli.eval import evaluate_run
    from moebit.runs.report import format_table, summarize

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = hf_folder(tmp_path / "hf")
    run = tmp_path / "run"
    cfg = {"init_from": str(src), "data": str(text_corpus(tmp_path, 20000)), "block_size": 16,
           "batch_size": 2, "steps": 2, "eval_every": 2, "eval_batches": 1, "dtype": "fp32",
           "warmup_steps": 0, "samples": 0, "threads": 1, "run_dir": str(run)}
    (end,) = run_on_ranks(_train, 1, args=(cfg, str(run)), timeout=180,
                          env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    tokenizer = str(src / "tokenizer.json")
    assert end["loss_unit"] == "token" and end["tokenizer"] == tokenizer
    assert 0.1 < end["tokens_per_byte"] < 1.0  # a BPE packs several bytes per token
    line = summary_line(end)
    assert f"nats/token of {tokenizer}" in line
    assert f"({bits_per_byte(end['val_loss'], end):.3f} bits/byte)" in line

    row = evaluate_run(str(run), as_trained=True)
    assert row["unit"] == "nats/token" and row["tokenizer"] == tokenizer
    assert row["tokens_per_byte"] == pytest.approx(end["tokens_per_byte"])
    assert row["bits_per_byte"] == pytest.approx(
        row["val_loss"] * row["tokens_per_byte"] / math.log(2))

    summary = summarize(run)
    assert summary["unit"] == "nats/token"
    assert summary["bits_per_byte"] == pytest.approx(bits_per_byte(end["val_loss"], end))
    table = format_table([summary])
    assert "nats/token" in table and f"per token of {tokenizer}" in table
    assert "unigram byte entropy" not in table
