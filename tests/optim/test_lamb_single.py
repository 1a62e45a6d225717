"""Exact Lamb and OnebitLamb in one process: the formula, warm-up equivalence, the
compression-stage coefficient rules, resume, errors, build and DeepSpeed."""

from __future__ import annotations

import io
import math

import pytest
import torch

from moebit.optim import Lamb, OnebitLamb, build_optimizer, optimizer_from_deepspeed_config

from toys import fit, flat_params, regression_mlp, sum_batch


def _model(seed: int = 0) -> torch.nn.Module:
    return regression_mlp(seed, n_in=6, hidden=16)


def test_lamb_matches_the_formula_written_out() -> None:
    """Three steps of the textbook formula in float64 against Lamb in float64."""
    torch.manual_seed(0)
    w = torch.randn(5, 4, dtype=torch.float64)
    z = torch.zeros(4, dtype=torch.float64)  # zero norm: ratio 1
    tiny = torch.full((3,), 1e-4, dtype=torch.float64)  # ratio below min_coeff: clipped
    params = [torch.nn.Parameter(t.clone()) for t in (w, z, tiny)]
    ref = [t.clone() for t in (w, z, tiny)]
    m = [torch.zeros_like(t) for t in ref]
    v = [torch.zeros_like(t) for t in ref]
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 1e-8, 0.01
    opt = Lamb(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, min_coeff=0.01, max_coeff=10)
    ratios = []
    for t in range(1, 4):
        grads = [torch.randn_like(r) for r in ref]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        step_ratios = []
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps) + wd * ref[i]
            wn, un = ref[i].norm().item(), u.norm().item()
            r = min(max(wn / un, 0.01), 10.0) if wn > 0 and un > 0 else 1.0
            ref[i] = ref[i] - lr * r * u
            step_ratios.append(r)
        ratios.append(step_ratios)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), r, rtol=1e-12, atol=1e-12)
    assert ratios[0][1] == 1.0 and ratios[0][2] == 0.01  # zero norm; clipped from below
    torch.testing.assert_close(opt.last_ratios[0].double(), torch.tensor(ratios[-1], dtype=torch.float64),
                               rtol=1e-6, atol=0)


def test_onebit_lamb_warmup_is_lamb_bit_for_bit() -> None:
    a, b = _model(), _model()
    ob = OnebitLamb(a.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=1000)
    ref = Lamb(b.parameters(), lr=1e-2, weight_decay=0.01)
    fit(a, ob, 0, range(20), batch=sum_batch)
    fit(b, ref, 0, range(20), batch=sum_batch)
    assert torch.equal(flat_params(a), flat_params(b))
    assert ob.comm_stage == "warmup" and ob.frozen_at is None


def test_compression_stage_factor_rules_and_exact_resume() -> None:
    kw = dict(lr=1e-2, weight_decay=0.01, freeze_step=6, factor_threshold=0.05)
    model = _model()
    opt = OnebitLamb(model.parameters(), **kw)
    fit(model, opt, 0, range(6), batch=sum_batch)
    vec = opt._coeff["group0"]
    frozen = vec["coeff_frozen"].clone()
    # Frozen coefficient: the bias-corrected EMA of clipped trust ratios.
    assert bool((frozen >= 0.01).all()) and bool((frozen <= 10).all())
    for p in model.parameters():
        assert torch.equal(opt.state[p]["exp_avg_sq_fresh"], opt.state[p]["exp_avg_sq"])
    last = vec["last_factor"].clone()
    for t in range(6, 16):
        fit(model, opt, 0, range(t, t + 1), batch=sum_batch)
        f = vec["last_factor"]
        assert bool((f <= last * 1.05 + 1e-6).all()) and bool((f >= last * 0.95 - 1e-6).all())
        assert bool((f >= 0.5).all()) and bool((f <= 4.0).all())
        last = f.clone()
    assert not torch.equal(vec["coeff_frozen"] * last, frozen)  # the factor moved
    assert torch.equal(vec["coeff_frozen"], frozen)  # the EMA did not

    half = _model()
    hopt = OnebitLamb(half.parameters(), **kw)
    fit(half, hopt, 0, range(10), batch=sum_batch)
    buf = io.BytesIO()
    torch.save({"m": half.state_dict(), "o": hopt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _model(seed=3)
    resumed.load_state_dict(saved["m"])
    ropt = OnebitLamb(resumed.parameters(), **kw)
    ropt.load_state_dict(saved["o"])
    fit(resumed, ropt, 0, range(10, 16), batch=sum_batch)
    assert torch.equal(flat_params(resumed), flat_params(model))


def test_one_rank_compression_stage_keeps_v_fresh_tracking_the_gradient() -> None:
    """On one rank m is exact, so the reconstructed gradient is the gradient itself."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = OnebitLamb([p], lr=1e-3, betas=(0.9, 0.5), freeze_step=2)
    for _ in range(2):
        p.grad = torch.full((8,), 1.0)
        opt.step()
    for _ in range(12):
        p.grad = torch.full((8,), 3.0)
        opt.step()
    # v_fresh forgets the old gradient at rate β2 = 0.5: close to 9 after 12 steps.
    torch.testing.assert_close(opt.state[p]["exp_avg_sq_fresh"], torch.full((8,), 9.0), rtol=1e-3, atol=0)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], torch.full((8,), 1.0), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(freeze_step=0), "freeze_step"),
        (dict(freeze_step="auto"), "auto"),
        (dict(min_coeff=-0.1), "min_coeff"),
        (dict(max_coeff=0.0), "max_coeff"),
        (dict(min_coeff=2.0, max_coeff=1.0), "must not exceed max_coeff"),
        (dict(coeff_beta=1.5), "coeff_beta"),
        (dict(factor_min=0.0), "factor_min"),
        (dict(factor_max=0.5), "factor_max"),
        (dict(factor_threshold=-0.1), "factor_threshold"),
        (dict(eps=-1.0), "eps"),
    ],
)
def test_onebit_lamb_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OnebitLamb(_model().parameters(), **kwargs)


def test_lamb_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb(_model().parameters(), min_coeff=math.nan)
    with pytest.raises(ValueError, match="Lamb param group 1: invalid learning rate"):
        m = _model()
        Lamb([{"params": [m[0].weight]}, {"params": [m[0].bias], "lr": -1}])


def test_build_and_deepspeed_types() -> None:
    lamb = build_optimizer("lamb", _model().parameters(), lr=1e-3, max_coeff=5.0)
    assert type(lamb) is Lamb and lamb.param_groups[0]["max_coeff"] == 5.0
    assert not getattr(lamb, "averages_gradients", False)  # the loop averages for it
    ob = build_optimizer("onebit_lamb", _model().parameters(), lr=1e-3, freeze_step=30, coeff_beta=0.8)
    assert type(ob) is OnebitLamb and ob.freeze_step == 30 and ob.coeff_beta == 0.8
    assert ob.averages_gradients
    cfg = {"optimizer": {"type": "OneBitLamb", "params": {
        "lr": 1e-3, "freeze_step": 50, "max_coeff": 0.3, "min_coeff": 0.01, "coeff_beta": 0.9,
        "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1, "cuda_aware": False,
        "comm_backend_name": "nccl"}}}
    ob = optimizer_from_deepspeed_config(cfg, _model().parameters())
    assert type(ob) is OnebitLamb and ob.freeze_step == 50 and ob.max_coeff == 0.3
    dflt = optimizer_from_deepspeed_config({"optimizer": {"type": "OneBitLamb"}}, _model().parameters())
    assert (dflt.freeze_step, dflt.max_coeff, dflt.min_coeff, dflt.coeff_beta) == (100000, 10.0, 0.01, 0.9)
    assert (dflt.factor_max, dflt.factor_min, dflt.factor_threshold) == (4.0, 0.5, 0.1)
    lamb = optimizer_from_deepspeed_config({"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}},
                                           _model().parameters())
    assert type(lamb) is Lamb and lamb.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match="unknown params .*factr_max"):
        optimizer_from_deepspeed_config(
            {"optimizer": {"type": "OneBitLamb", "params": {"factr_max": 3}}}, _model().parameters())
