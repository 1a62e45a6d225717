"""``moebit eval``: reproduces training's validation loss and scores the whole split."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moebit.cli.eval import main, split_windows
from moebit.testing import run_on_ranks
from moebit.training.config import build


def _train_run(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def test_split_windows_cover_every_byte_once() -> None:
    data = np.arange(103, dtype=np.uint8)
    batches = split_windows(data, block_size=10, batch_size=4)
    assert [len(x) for x, _ in batches] == [4, 4, 2]  # 10 windows: bytes 1..100 as targets
    x = torch.cat([b[0] for b in batches]).reshape(-1)
    y = torch.cat([b[1] for b in batches]).reshape(-1)
    assert torch.equal(x, torch.arange(100)) and torch.equal(y, torch.arange(1, 101))
    assert len(split_windows(data, 10, 4, max_batches=2)) == 2
    with pytest.raises(ValueError, match="shorter than one window"):
        split_windows(data[:10], 10, 4)


def test_eval_of_an_ep2_run(small_corpus: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    cfg = {"data": str(small_corpus), "n_layer": 4, "n_head": 2, "d_model": 32,
           "block_size": 32, "batch_size": 4, "steps": 8, "lr": 3e-3, "warmup_steps": 0,
           "eval_every": 100, "eval_batches": 3, "log_every": 4, "dtype": "fp32",
           "samples": 0, "num_experts": [2, 4], "moe_residual": True, "ep_size": 2}
    s0, _ = run_on_ranks(_train_run, 2, args=(cfg, str(run)), timeout=120)

    out = tmp_path / "as_trained.json"
    assert main([str(run), "--as-trained", "--json", str(out)]) == 0
    row = json.loads(out.read_text())[0]
    # one process with every expert scores the run's own windows as its 2 ranks did
    assert row["val_loss"] == pytest.approx(s0["val_loss"], abs=1e-4)
    assert row["step"] == 8 and row["windows"] == 3 * 4

    out, png = tmp_path / "full.json", tmp_path / "seeds.png"
    assert main([str(run), str(run / "checkpoints" / "step-00000008"), "--json", str(out),
                 "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    full, same = json.loads(out.read_text())
    from moebit.training.data import load_corpus

    assert full["windows"] == (len(load_corpus(str(small_corpus)).val) - 1) // 32
    assert full["val_loss"] == same["val_loss"] and 0 < full["val_loss"] < 5.6
    table = capsys.readouterr().out
    assert "vs first" in table and "+0.00%" in table

    assert main([str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
