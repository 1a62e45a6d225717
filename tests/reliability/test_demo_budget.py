"""``make demo`` (the README's first command) must finish within 10 minutes on a 2-core x86
machine. Each of the demo's rows trains a few real steps here, on 2 gloo ranks of one
thread each, in the dtype ``--dtype auto`` picks on this machine, and the demo's time is
projected from the measured step and evaluation times.

The times are each rank's CPU seconds (``time.process_time``), not wall seconds: this
machine is shared, and on a busy one a wall clock measures the neighbours. On an idle
2-core machine each rank has its core, so a step takes about its CPU time."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from moebit.cli.demo import DEMO_MODEL, PLAN
from moebit.cli.train import parse_train_args
from moebit.runs import dtype_probe
from moebit.testing import run_on_ranks

BUDGET_S = 600.0
# Per row, not measured here: torchrun and two rank start-ups, reading the ~30 MB standard
# library corpus, the sample text of the first row (measured ~10-15 s on this machine).
START_ALLOWANCE_S = 25.0
STEPS = 4  # the first is a warm-up and is not counted


def _train_body(rank: int, world: int, cfg_dict: dict, run_dir: str) -> tuple[float, float]:
    """(CPU seconds per training step after the first, CPU seconds of the final save and
    evaluation) on this rank, through the real loop."""
    import time

    from moebit.comm.collectives import init_from_env
    from moebit.training.config import build
    from moebit.training.hooks import Hooks
    from moebit.training.loop import train

    starts: list[float] = []
    evaluated: list[float] = []
    hooks = Hooks(before_step=lambda loop, step: starts.append(time.process_time()),
                  evaluated=lambda loop, step, loss: evaluated.append(time.process_time()) or {})
    train(build(cfg_dict), Path(run_dir), init_from_env("cpu"), hooks)
    steps = [b - a for a, b in zip(starts[1:], starts[2:], strict=False)]
    step_s = statistics.median(steps)
    return step_s, evaluated[-1] - starts[-1] - step_s


def row_config(extra: list[str], corpus: Path, dtype: str) -> tuple[dict, int, int]:
    """The demo row's config cut to ``STEPS`` steps, and the demo's steps and eval period."""
    cfg, _ = parse_train_args(DEMO_MODEL + extra)
    demo_steps, eval_every = 250, cfg.eval_every  # moebit demo's default --steps
    cfg.steps, cfg.log_every, cfg.eval_every, cfg.samples = STEPS, 1, STEPS, 0
    cfg.data, cfg.dtype, cfg.threads = str(corpus), dtype, 1
    return cfg.to_dict(), demo_steps, eval_every


@pytest.mark.timeout(420)
def test_the_demo_fits_in_ten_minutes_here(tmp_path: Path, small_corpus: Path):
    choice = dtype_probe.resolve("auto", "cpu")
    total, lines = 0.0, []
    for name, extra in PLAN:
        cfg, demo_steps, eval_every = row_config(extra, small_corpus, choice.dtype)
        per_rank = run_on_ranks(_train_body, 2, args=(cfg, str(tmp_path / name)), timeout=300)
        step_s, eval_s = (max(t) for t in zip(*per_rank, strict=True))  # the slower rank sets the pace
        assert (tmp_path / name / "metrics.jsonl").is_file()  # the real loop ran and logged
        evals = -(-demo_steps // eval_every)
        row = START_ALLOWANCE_S + demo_steps * step_s + evals * eval_s
        lines.append(f"{name}: {step_s:.3f} s/step, {eval_s:.2f} s/eval -> {row:.0f} s")
        total += row
    report = f"{choice.line()}; " + "; ".join(lines) + f"; projected demo {total:.0f} s"
    print(report)
    assert total < BUDGET_S, report
