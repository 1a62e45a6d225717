"""A finished 1-rank run folder made in-process (no ranks): config, metrics, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moebit.comm.collectives import DistInfo
from moebit.models.gpt import GPT
from moebit.runs.metrics import MetricsWriter
from moebit.training import state as ckpt_io
from moebit.training.config import TrainConfig, build
from moebit.training.data import TrainBatches, load_corpus
from moebit.training.setup import make_optimizer, param_groups

TINY = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32, "batch_size": 4, "steps": 4,
        "samples": 0, "dtype": "fp32", "eval_batches": 1, "threads": 1}


def make_run(run: Path, corpus: Path, steps: tuple[int, ...] = (2, 4), **over: object) -> TrainConfig:
    cfg = build({**TINY, "data": str(corpus), "run_dir": str(run), **over})
    model = GPT(cfg.model_config())
    opt = make_optimizer(cfg, param_groups(model, cfg))
    data = load_corpus(cfg.data)
    batches = TrainBatches(data.train, cfg.model.block_size, cfg.batch_size, cfg.seed, 0)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    with MetricsWriter(run / "metrics.jsonl") as log:
        log.emit({"kind": "start", "n_params": model.num_params()})
        for s in steps:
            log.emit({"kind": "train", "step": s, "loss": 5.0})
            ckpt_io.save(run, s, model, opt, batches, info, cfg, wall=0.0, train_time=0.0)
    return cfg


@pytest.fixture
def finished_run(tmp_path: Path, small_corpus: Path) -> Path:
    run = tmp_path / "run"
    make_run(run, small_corpus)
    return run
