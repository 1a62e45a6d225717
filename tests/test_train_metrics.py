"""The loop's meter: window means (hooks' metrics included) and whole-run totals."""

from pathlib import Path

import torch

from moebit.comm import stats
from moebit.training.meter import Meter, RunTotals
from moebit.training.setup import saved_totals
from moebit.training.state import Resumed


def test_totals_add_earlier_attempts_to_this_attempts_traffic() -> None:
    stats.record("before_the_run", 1000, 1000)  # another run in this process: not counted
    origin = stats.snapshot()
    earlier = RunTotals(bytes_sent=10, bytes_recv=20, collectives=3, train_time=1.5,
                        steps_trained=4, tokens=400, clipped_steps=1, nan_skipped=2)
    m = Meter(100, earlier, is_moe=False, origin=origin)
    stats.record("grad_allreduce", 7, 9)
    m.step(0.5, loss=2.0, aux=0.0, norm=3.0, clipped=True, extra={}, ffn_outputs=[])
    t = m.totals()
    assert (t.bytes_sent, t.bytes_recv, t.collectives) == (17, 29, 4)
    assert (t.train_time, t.steps_trained, t.tokens) == (2.0, 5, 500)
    assert (t.clipped_steps, t.nan_skipped) == (2, 2)
    assert m.tokens_per_s() == 250.0
    assert RunTotals.from_dict(t.to_dict()) == t


def test_train_record_averages_the_window_and_hook_metrics_where_reported() -> None:
    m = Meter(10, RunTotals(), is_moe=False, origin=stats.snapshot())
    m.step(1.0, 4.0, 0.0, 2.0, True, {"kd_loss": 1.0}, [])
    m.step(1.0, 2.0, 0.0, 4.0, False, {"kd_loss": 3.0}, [])
    m.step(2.0, 3.0, 0.0, 6.0, False, {}, [])  # the KD stage ended
    rec = m.train_record(3, 1e-3, wall=5.0, opt=torch.optim.SGD([torch.zeros(1)], lr=1.0))
    assert rec["loss"] == 3.0 and rec["grad_norm"] == 4.0 and rec["clipped_frac"] == 1 / 3
    assert rec["kd_loss"] == 2.0  # over the 2 steps that had the term
    assert rec["tokens_per_s"] == 30 / 4.0 and "aux_loss" not in rec
    assert m.win.n == 0 and m.win.extra == {}  # the next window starts empty


def test_a_checkpoint_without_counters_keeps_its_time_and_steps() -> None:
    old = Resumed(step=6, wall=9.0, train_time=3.0, path=Path("x"), resharded=False)
    t = saved_totals(old, tokens_per_step=256)
    assert (t.train_time, t.steps_trained, t.tokens, t.bytes_sent) == (3.0, 6, 6 * 256, 0)
    assert saved_totals(None, 256) == RunTotals()
    assert RunTotals.from_dict({"bytes_sent": 5, "not_a_counter": 1}) == RunTotals(bytes_sent=5)
