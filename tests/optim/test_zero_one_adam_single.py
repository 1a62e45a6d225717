"""ZeroOneAdam in one process: Adam equivalence, schedules, resume, errors, build and DeepSpeed."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from moebit.optim import ZeroOneAdam, build_optimizer, optimizer_from_deepspeed_config

from toys import fit, flat_params, regression_mlp, sum_batch


def _model(seed: int = 0) -> torch.nn.Module:
    return regression_mlp(seed, n_in=6, hidden=16)


def test_stage1_refreshing_every_step_is_torch_adamw_bit_for_bit() -> None:
    a, b = _model(), _model()
    zo = ZeroOneAdam(a.parameters(), lr=1e-2, weight_decay=0.1, var_freeze_step=1000,
                     var_update_scaler=10**6)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    fit(a, zo, 0, range(25), batch=sum_batch)
    fit(b, ref, 0, range(25), batch=sum_batch)
    assert torch.equal(flat_params(a), flat_params(b))
    assert zo.comm_stage == "variance" and zo.comm_rounds == 0  # one rank sends nothing


def test_variance_refresh_interval_doubles() -> None:
    model = _model()
    opt = ZeroOneAdam(model.parameters(), var_freeze_step=1000, var_update_scaler=3)
    seen = []
    for t in range(1, 22):
        fit(model, opt, 0, range(t, t + 1), batch=sum_batch)
        seen.append(opt.var_interval)
    # 3 refreshes at interval 1 (steps 1-3), 3 at interval 2 (4, 6, 8), 3 at 4 (12, 16, 20).
    assert seen[:3] == [1, 1, 2] and seen[7] == 4 and seen[19] == 8
    assert opt.var_updates == 9


def test_v_changes_only_on_refresh_steps() -> None:
    model = _model()
    opt = ZeroOneAdam(model.parameters(), var_freeze_step=1000, var_update_scaler=1)
    p = next(model.parameters())
    changed = []
    for t in range(1, 9):
        before = opt.state[p]["exp_avg_sq"].clone() if opt.state.get(p) else torch.zeros_like(p)
        fit(model, opt, 0, range(t, t + 1), batch=sum_batch)
        changed.append(not torch.equal(before, opt.state[p]["exp_avg_sq"]))
    # Interval doubles after every refresh: refreshes at steps 1, 2, 4, 8.
    assert changed == [True, True, False, True, False, False, False, True]


def test_local_interval_doubles_up_to_the_clipper_and_resume_is_exact() -> None:
    kw = dict(lr=1e-2, var_freeze_step=5, local_step_scaler=3, local_step_clipper=4)
    model = _model()
    opt = ZeroOneAdam(model.parameters(), **kw)
    intervals = []
    for t in range(30):
        fit(model, opt, 0, range(t, t + 1), batch=sum_batch)
        intervals.append(opt.local_step_interval)
    assert opt.frozen_at == 5 and opt.comm_stage == "local"
    assert intervals[4] == 1 and intervals[7] == 2 and intervals[10] == 4 and max(intervals) == 4

    half = _model()
    half_opt = ZeroOneAdam(half.parameters(), **kw)
    fit(half, half_opt, 0, range(17), batch=sum_batch)
    buf = io.BytesIO()
    torch.save({"m": half.state_dict(), "o": half_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _model(seed=5)
    resumed.load_state_dict(saved["m"])
    ropt = ZeroOneAdam(resumed.parameters(), **kw)
    ropt.load_state_dict(saved["o"])
    fit(resumed, ropt, 0, range(17, 30), batch=sum_batch)
    assert torch.equal(flat_params(resumed), flat_params(model))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(var_freeze_step=0), "var_freeze_step"),
        (dict(var_update_scaler=0), "var_update_scaler"),
        (dict(local_step_scaler=1.5), "local_step_scaler"),
        (dict(local_step_clipper=-1), "local_step_clipper"),
        (dict(freeze_step="auto"), "auto"),
        (dict(lr=-1.0), "learning rate"),
        (dict(betas=(0.9, 1.0)), "beta2"),
        (dict(amsgrad=True), "amsgrad"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroOneAdam(_model().parameters(), **kwargs)


def test_state_dict_of_another_optimizer_is_refused() -> None:
    from moebit.optim import OnebitAdam

    model = _model()
    ob = OnebitAdam(model.parameters(), freeze_step=2)
    fit(model, ob, 0, range(3), batch=sum_batch)
    with pytest.raises(ValueError, match="OnebitAdam state_dict cannot be loaded into ZeroOneAdam"):
        ZeroOneAdam(model.parameters()).load_state_dict(ob.state_dict())


def test_build_maps_freeze_step_to_var_freeze_step() -> None:
    opt = build_optimizer("zero_one_adam", _model().parameters(), lr=1e-3, freeze_step=40,
                          local_step_scaler=10)
    assert isinstance(opt, ZeroOneAdam)
    assert opt.var_freeze_step == 40 and opt.local_step_scaler == 10
    with pytest.raises(ValueError, match="not both"):
        build_optimizer("zero_one_adam", _model().parameters(), lr=1e-3, freeze_step=4,
                        var_freeze_step=5)
    with pytest.raises(ValueError, match="auto"):
        build_optimizer("zero_one_adam", _model().parameters(), lr=1e-3, freeze_step="auto")


def test_deepspeed_zero_one_adam(caplog) -> None:
    cfg = {"optimizer": {"type": "ZeroOneAdam", "params": {
        "lr": 2e-4, "weight_decay": 0.01, "var_freeze_step": 70, "var_update_scaler": 8,
        "local_step_scaler": 100, "local_step_clipper": 8, "cuda_aware": False,
        "comm_backend_name": "nccl"}}}
    with caplog.at_level(logging.INFO, logger="moebit.optim"):
        opt = optimizer_from_deepspeed_config(cfg, _model().parameters())
    assert isinstance(opt, ZeroOneAdam)
    assert (opt.var_freeze_step, opt.var_update_scaler) == (70, 8)
    assert (opt.local_step_scaler, opt.local_step_clipper) == (100, 8)
    assert opt.param_groups[0]["lr"] == 2e-4 and opt.param_groups[0]["weight_decay"] == 0.01
    assert any("cuda_aware" in r.message and "not needed" in r.message for r in caplog.records)
    dflt = optimizer_from_deepspeed_config({"optimizer": {"type": "ZeroOneAdam"}}, _model().parameters())
    assert (dflt.var_freeze_step, dflt.var_update_scaler) == (100000, 16)
    assert (dflt.local_step_scaler, dflt.local_step_clipper) == (32678, 16)
    with pytest.raises(ValueError, match="unknown params .*freeze_step"):
        optimizer_from_deepspeed_config(
            {"optimizer": {"type": "ZeroOneAdam", "params": {"freeze_step": 3}}}, _model().parameters())


def test_only_variance_refresh_steps_average_exactly() -> None:
    from moebit.optim import ZeroOneAdam

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = ZeroOneAdam([p], lr=1e-2, var_freeze_step=100, var_update_scaler=1)
    exact = []
    for _ in range(8):
        exact.append(opt.next_step_averages_exactly)
        p.grad = torch.randn(5)
        opt.step()
    # The refresh interval starts at 1 and doubles after each refresh (scaler 1): 1, 2, 4, 8.
    assert exact == [True, True, False, True, False, False, False, True]
