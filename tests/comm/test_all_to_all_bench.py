"""``moebit bench a2a``'s summary: the wire floor and the per-phase split (no ranks needed)."""

from __future__ import annotations

import argparse

import pytest
import torch

from moebit.bench import a2a as bench


def test_summary_reports_the_floor_and_the_phases() -> None:
    args = argparse.Namespace(link="1gbit", two_nodes=False)
    # 2 ranks x 3 reps x [splits, codec, wire]; rank 1 is slower
    t = torch.tensor([[[0.01, 0.02, 0.10]] * 3, [[0.01, 0.02, 0.20]] * 3], dtype=torch.float64)
    link = {"int8": torch.tensor([25e6, 0.0, 0.0], dtype=torch.float64)}  # all ranks' bytes
    out = bench._summary(args, [("int8", None)], t.unsqueeze(1), link, {"int8": 12e6})["int8"]
    assert out["floor_s_per_step"] == pytest.approx(0.2)  # 25 MB at 125 MB/s
    assert out["s_per_step"] == pytest.approx(0.18) and out["s_per_step_slowest_rank"] == pytest.approx(0.23)
    assert (out["splits_s_per_step"], out["codec_s_per_step"]) == (0.01, 0.02)
    assert out["wire_s_per_step"] == pytest.approx(0.15)
    assert (out["MB_sent_per_step_rank0"], out["MB_on_link_per_step"]) == (12.0, 25.0)


def test_two_nodes_floor_is_the_busier_direction_and_no_link_has_none() -> None:
    t = torch.full((1, 1, 2, 3), 0.01, dtype=torch.float64)
    link = {"fp32": torch.tensor([9e6, 1e6, 2.5e6], dtype=torch.float64)}
    two = bench._summary(argparse.Namespace(link="1gbit", two_nodes=True),
                         [("fp32", None)], t, link, {"fp32": 1.0})["fp32"]
    assert two["floor_s_per_step"] == pytest.approx(0.02) and two["MB_on_link_per_step"] == 2.5
    plain = bench._summary(argparse.Namespace(link=None, two_nodes=False),
                           [("fp32", None)], t, link, {"fp32": 1.0})["fp32"]
    assert plain["floor_s_per_step"] is None
