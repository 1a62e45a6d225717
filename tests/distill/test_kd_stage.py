"""The KD stage as loop hooks, on one process: its stop rule, its term, its saved state."""

import pytest
import torch

from moebit.comm.collectives import DistInfo
from moebit.distill.run import DistillConfig, DistillError, KDStage
from moebit.models.gpt import GPT, GPTConfig
from moebit.training.config import build
from moebit.training.hooks import Loop


def _stage_and_loop(**dvals) -> tuple[KDStage, Loop, list[dict]]:
    torch.manual_seed(0)
    mcfg = GPTConfig(block_size=8, n_layer=1, n_head=2, d_model=16)
    teacher, student = GPT(mcfg), GPT(mcfg)
    cfg = build({"n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8, "steps": 10,
                 "dtype": "fp32"})
    data = torch.randint(0, 256, (2, 9))
    records: list[dict] = []
    loop = Loop(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None), student,
                torch.optim.SGD(student.parameters(), lr=0.1), [(data[:, :-1], data[:, 1:])],
                records.append)
    d = DistillConfig(teacher="unused", student_layers=1, teacher_dtype="fp32", **dvals)
    return KDStage(d, teacher, 0, [0], d.kd_steps(cfg.steps)), loop, records


def test_fraction_stop_turns_the_term_off_and_records_it_once() -> None:
    kd, loop, records = _stage_and_loop(kd_stop_fraction=0.3, kd_stop_rule="fraction")
    x, y = loop.val_batches[0]
    for step in range(5):
        kd.before_step(loop, step)
        term = kd.extra_loss((x, y), loop.model(x, y))
        assert (term is not None) == (step < 3)
        if term is not None:
            assert term[0].requires_grad and term[1]["kd_loss"] > 0
    assert [(r["kind"], r["step"], r["rule"]) for r in records] == [("kd_stop", 3, "fraction")]
    assert kd.used == 3


def test_no_kd_stops_before_the_first_step() -> None:
    kd, loop, records = _stage_and_loop(no_kd=True)
    kd.before_step(loop, 0)
    assert not kd.active and records[0]["step"] == 0 and "--no-kd" in records[0]["reason"]


def test_state_round_trips_and_foreign_state_is_refused() -> None:
    kd, loop, _ = _stage_and_loop()
    kd.start(loop)
    kd.active, kd.used = False, 4
    fresh, _, _ = _stage_and_loop()
    fresh.load_state_dict(kd.state_dict())
    assert (fresh.active, fresh.used, fresh.teacher_val) == (False, 4, kd.teacher_val)
    fresh.load_state_dict({})  # a fresh run: nothing to restore
    assert fresh.used == 4
    with pytest.raises(DistillError, match="KD state has keys"):
        fresh.load_state_dict({"steps": 3})
