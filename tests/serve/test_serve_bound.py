"""``moebit.bench.serve_bound``: the most continuous batching can gain over static
batching, replayed from step costs, and the step costs measured on a real model."""

from __future__ import annotations

import pytest
import torch

from moebit.bench.serve_bound import _cost, decode_bound, step_costs
from moebit.models.hf.config import HFDecoderConfig
from moebit.models.hf.decoder import HFDecoder


def test_steps_that_cost_the_same_at_any_rows_give_the_schedules_step_ratio() -> None:
    # static: two batches of 2, each 3 steps; continuous with 2 slots: 5 steps
    r = decode_bound([1, 3, 1, 3], batch=2, slots=2, costs={1: 1.0, 2: 1.0})
    assert (r["static_ms"], r["continuous_ms"]) == (6.0, 5.0)
    assert r["bound"] == r["bound_vs_live"] == r["uniform_bound"] == 1.2


def test_steps_that_cost_their_rows_leave_nothing_to_gain_over_dropping_finished_rows() -> None:
    """A step priced per row: continuous batching and a static batcher that drops its
    finished rows both pay once per token generated; the static batcher that computes
    every row to the batch's longest pays for the idle rows too."""
    budgets = [8, 16, 32, 64, 128, 8, 128, 32, 16, 64] * 4
    r = decode_bound(budgets, batch=8, slots=8, costs={1: 0.5, 2: 1.0, 4: 2.0, 8: 4.0})
    assert r["static_live_ms"] == r["continuous_ms"] == pytest.approx(0.5 * sum(budgets))
    assert r["bound_vs_live"] == 1.0 and r["uniform_bound"] > 2.0
    longest = sum(max(budgets[i:i + 8]) for i in range(0, len(budgets), 8))
    assert r["static_ms"] == pytest.approx(4.0 * longest)
    assert r["bound"] == round(4.0 * longest / (0.5 * sum(budgets)), 3) > 2.0


def test_costs_between_and_beyond_the_measured_rows_follow_the_segments() -> None:
    costs = {1: 1.0, 4: 4.0, 8: 6.0}
    assert _cost(costs, 0) == 0.0
    assert _cost(costs, 2) == pytest.approx(2.0)
    assert _cost(costs, 6) == pytest.approx(5.0)
    assert _cost(costs, 12) == pytest.approx(8.0)  # the last segment's slope, 0.5 a row
    assert _cost({4: 2.0}, 8) == pytest.approx(4.0)  # one point: proportional


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="batch 0"):
        decode_bound([4], batch=0, slots=1, costs={1: 1.0})
    with pytest.raises(ValueError, match="every budget"):
        decode_bound([4, 0], batch=2, slots=2, costs={1: 1.0})


def test_step_costs_time_a_real_model_at_each_row_count() -> None:
    torch.manual_seed(0)
    m = HFDecoder(HFDecoderConfig.from_hf(dict(
        model_type="mixtral", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))).eval()
    costs = step_costs(m, 6, 64, prompt=4, steps=3)
    assert sorted(costs) == [1, 2, 4, 6] and all(ms > 0 for ms in costs.values())
