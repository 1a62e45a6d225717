"""Calibration on this machine: short runs that return positive, finite rates."""

from __future__ import annotations

import math

import pytest

from moebit.plan import calibrate as cal
from moebit.training.config import build


def _ok(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_device_rates() -> None:
    assert _ok(cal.matmul_rate(n=128, reps=3))
    assert _ok(cal.pack_rate(n=1 << 14, reps=2))
    assert _ok(cal.update_rate(n=1 << 14, reps=2))


def test_fit_line() -> None:
    a, b = cal._fit_line([1.0, 2.0, 3.0], [3.0, 5.0, 7.0])
    assert (a, b) == pytest.approx((1.0, 2.0))


@pytest.mark.slow
def test_link_and_model_step() -> None:
    alpha, beta = cal.link_alpha_beta(2, sizes=[1 << 12, 1 << 16, 1 << 20, 1 << 21], reps=3)
    assert alpha >= 0 and math.isfinite(alpha) and _ok(beta)
    cfg = build(None, dict(n_layer=1, d_model=32, n_head=2, block_size=16, batch_size=2,
                           threads=1))
    assert _ok(cal.model_step_seconds(cfg, procs=1, steps=2))
