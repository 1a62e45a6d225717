"""OnebitAdam on one process: warm-up is torch's Adam, the freeze, state, arguments."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from moebit.optim import AutoFreeze, OnebitAdam


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 7, generator=g), torch.randn(16, 3, generator=g)) for _ in range(n)]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_warmup_is_torch_adam_bit_for_bit(weight_decay: float) -> None:
    ref, ours = _model(), _model()
    # Two groups with their own lr: groups are laid out as separate flat buffers.
    def groups(m):
        return [
            {"params": m[0].parameters()},
            {"params": m[2].parameters(), "lr": 3e-3},
        ]

    torch_cls = torch.optim.AdamW if weight_decay else torch.optim.Adam
    opt_ref = torch_cls(groups(ref), lr=1e-2, weight_decay=weight_decay)
    opt = OnebitAdam(groups(ours), lr=1e-2, weight_decay=weight_decay, freeze_step=10_000)
    batches = _batches(40)
    _train(ref, opt_ref, batches)
    _train(ours, opt, batches)
    for p, q in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(opt_ref.state[p]["exp_avg"], opt.state[q]["exp_avg"])
        assert torch.equal(opt_ref.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])
    assert opt.comm_stage == "warmup" and opt.frozen_at is None


def test_chunked_update_of_a_large_parameter_is_still_torch_adam() -> None:
    torch.manual_seed(0)
    w_ref = torch.nn.Parameter(torch.randn(700, 600))  # > _CHUNK elements: updated in chunks
    w = torch.nn.Parameter(w_ref.detach().clone())
    opt_ref = torch.optim.AdamW([w_ref], lr=1e-2, weight_decay=0.1)
    opt = OnebitAdam([w], lr=1e-2, weight_decay=0.1, freeze_step=100)
    for _ in range(3):
        g = torch.randn(700, 600)
        w_ref.grad, w.grad = g, g.clone()
        opt_ref.step()
        opt.step()
    assert torch.equal(w_ref, w)
    assert w.grad is not None and torch.equal(w.grad, g)  # one rank: the average is itself


def test_freeze_folds_bias_correction_and_keeps_v_fixed() -> None:
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=5)
    batches = _batches(12)
    _train(model, opt, batches[:5])
    assert opt.comm_stage == "compressed" and opt.frozen_at == 5
    # exp_avg_sq now holds the bias-corrected v̂ of step 5.
    ref, ref_opt = _model(), None
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, batches[:5])
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        expected = ref_opt.state[p]["exp_avg_sq"] / (1 - 0.999**5)
        torch.testing.assert_close(opt.state[q]["exp_avg_sq"], expected, rtol=1e-6, atol=0)
    frozen = [opt.state[q]["exp_avg_sq"].clone() for q in model.parameters()]
    # One compressed step on one rank: m is exact, the update uses the frozen v̂.
    x, y = batches[5]
    before = [p.detach().clone() for p in model.parameters()]
    m_before = [opt.state[q]["exp_avg"].clone() for q in model.parameters()]
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for i, p in enumerate(model.parameters()):
        m = 0.9 * m_before[i] + 0.1 * grads[i]
        step = 1e-2 / (1 - 0.9**6) * m / (frozen[i].sqrt() + 1e-8)
        torch.testing.assert_close(p.detach(), before[i] - step, rtol=1e-5, atol=1e-7)
        assert torch.equal(opt.state[p]["exp_avg_sq"], frozen[i])


def test_missing_gradient_counts_as_zero() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = OnebitAdam([a, b], lr=0.1, freeze_step=100)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2))  # zero gradient, zero m: no move
    assert opt.state[b]["exp_avg"].abs().sum() == 0
    assert (a.detach() < 1).all()


def test_exp_avg_mask_zeroes_momentum_after_the_freeze() -> None:
    w = torch.nn.Parameter(torch.zeros(4, 3))
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0]).view(4, 1)
    opt = OnebitAdam([{"params": [w], "exp_avg_mask": mask}], lr=0.1, freeze_step=1)
    for _ in range(3):
        w.grad = torch.ones(4, 3)
        opt.step()
    assert opt.state[w]["exp_avg"][2].abs().sum() == 0
    assert opt.state[w]["exp_avg"][0].abs().sum() > 0


def test_state_dict_round_trip_is_bit_exact_through_the_freeze() -> None:
    batches = _batches(30)
    full, full_opt = _model(), None
    full_opt = OnebitAdam(full.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=10)
    _train(full, full_opt, batches)

    half = _model()
    half_opt = OnebitAdam(half.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=10)
    _train(half, half_opt, batches[:15])
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": half_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = _model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    resumed_opt = OnebitAdam(resumed.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=10)
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.frozen_at == 10 and resumed_opt.step_count == 15
    _train(resumed, resumed_opt, batches[15:])
    for p, q in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dict_rejects_foreign_state() -> None:
    model = _model()
    adam = torch.optim.Adam(model.parameters())
    opt = OnebitAdam(model.parameters())
    with pytest.raises(ValueError, match="not a OnebitAdam state_dict"):
        opt.load_state_dict(adam.state_dict())


def _stabilizing_run(opt_kwargs: dict, steps: int, lr_warmup: int = 0) -> OnebitAdam:
    """Linear regression with fresh noise each step: v settles at the noise level."""
    torch.manual_seed(0)
    w_true = torch.randn(20, 1)
    lin = torch.nn.Linear(20, 1)
    opt = OnebitAdam(lin.parameters(), lr=1e-2, **opt_kwargs)
    for t in range(steps):
        if lr_warmup:
            opt.param_groups[0]["lr"] = 1e-2 * min(1.0, (t + 1) / lr_warmup)
        x = torch.randn(64, 20)
        y = x @ w_true + 0.5 * torch.randn(64, 1)
        opt.zero_grad()
        ((lin(x) - y) ** 2).mean().backward()
        opt.step()
        if opt.frozen_at is not None:
            break
    return opt


def test_auto_freeze_triggers_on_a_stabilizing_problem(caplog) -> None:
    rule = AutoFreeze(window=20, threshold=0.05, patience=2, min_steps=60)
    with caplog.at_level(logging.INFO, logger="moebit.optim"):
        opt = _stabilizing_run({"freeze_step": "auto", "auto_freeze": rule}, steps=2000)
    assert opt.frozen_at is not None, f"never froze; last drift {rule.last_drift}"
    assert opt.frozen_at >= 60 and opt.frozen_at % 20 == 0
    assert opt.frozen_at < 300  # (so the learning-rate warm-up test below means something)
    assert rule.last_drift is not None and rule.last_drift < 0.05
    assert rule.snapshot is None  # released at the freeze
    assert any("variance frozen after step" in r.message for r in caplog.records)


def test_auto_freeze_waits_for_the_learning_rate_warmup() -> None:
    rule = AutoFreeze(window=20, threshold=0.05, patience=2, min_steps=60)
    opt = _stabilizing_run({"freeze_step": "auto", "auto_freeze": rule}, 2000, lr_warmup=300)
    assert opt.frozen_at is not None and opt.frozen_at >= 300 + 20


def test_auto_freeze_thresholds_from_a_dict() -> None:
    opt = OnebitAdam(_model().parameters(), freeze_step="auto", auto_freeze={"window": 7})
    assert opt.auto_freeze is not None and opt.auto_freeze.window == 7
    with pytest.raises(TypeError):
        OnebitAdam(_model().parameters(), freeze_step="auto", auto_freeze={"windw": 7})


def test_auto_freeze_waits_while_v_drifts() -> None:
    rule = AutoFreeze(window=10, threshold=0.01, patience=2, min_steps=20)
    # Gradients grow 5% per step: v never stabilizes, so only max_steps could freeze.
    p = torch.nn.Parameter(torch.zeros(100))
    opt = OnebitAdam([p], lr=1e-3, freeze_step="auto", auto_freeze=rule)
    for t in range(200):
        p.grad = torch.full((100,), 1.05**t)
        opt.step()
    assert opt.frozen_at is None and rule.last_drift > 0.01
    capped = AutoFreeze(window=10, threshold=0.01, min_steps=20, max_steps=150)
    opt = OnebitAdam([p], lr=1e-3, freeze_step="auto", auto_freeze=capped)
    for t in range(200):
        p.grad = torch.full((100,), 1.05**t)
        opt.step()
    assert opt.frozen_at == 150


def test_memory_ratio_single_rank() -> None:
    model = _model()
    opt = OnebitAdam(model.parameters(), freeze_step=1)
    ref = _model()
    adam = torch.optim.Adam(ref.parameters())
    _train(model, opt, _batches(2))
    _train(ref, adam, _batches(1))
    adam_bytes = sum(
        s[k].numel() * s[k].element_size()
        for s in adam.state.values()
        for k in ("exp_avg", "exp_avg_sq")
    )
    assert opt.state_bytes() <= adam_bytes  # one rank: no error buffers at all


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1e-3}, "learning rate"),
        ({"betas": (1.0, 0.999)}, "beta1"),
        ({"betas": (0.9, -0.1)}, "beta2"),
        ({"betas": (0.9,)}, "betas must be a pair"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"amsgrad": True}, "amsgrad"),
        ({"freeze_step": 0}, "freeze_step"),
        ({"freeze_step": -5}, "freeze_step"),
        ({"freeze_step": 2.5}, "freeze_step"),
        ({"freeze_step": True}, "freeze_step"),
        ({"freeze_step": "soon"}, "freeze_step"),
        ({"freeze_step": 10, "auto_freeze": AutoFreeze()}, "auto_freeze"),
        ({"ddp_hook_state": object()}, "grads_averaged_externally"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OnebitAdam(_model().parameters(), **kwargs)


def test_bad_group_and_rule_arguments() -> None:
    m = _model()
    with pytest.raises(ValueError, match="param group 1: invalid learning rate"):
        OnebitAdam([{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": -1.0}])
    with pytest.raises(ValueError, match="exp_avg_mask has 1 entries"):
        OnebitAdam([{"params": m[0].parameters(), "exp_avg_mask": [None]}])
    with pytest.raises(ValueError, match="window"):
        AutoFreeze(window=0)
    with pytest.raises(ValueError, match="threshold"):
        AutoFreeze(threshold=0.0)
    with pytest.raises(ValueError, match="max_steps"):
        AutoFreeze(min_steps=100, max_steps=50)


def test_sparse_gradients_are_rejected() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OnebitAdam(emb.parameters(), freeze_step=10)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


def test_no_param_group_after_the_freeze() -> None:
    m = _model()
    opt = OnebitAdam(m[0].parameters(), freeze_step=1)
    m[0].weight.grad = torch.ones_like(m[0].weight)
    opt.step()
    with pytest.raises(ValueError, match="after the variance was frozen"):
        opt.add_param_group({"params": m[2].parameters()})


def test_grads_are_averaged_only_while_the_step_averages_exactly() -> None:
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    batches = _batches(3)
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if i < 2:
            assert opt.next_step_averages_exactly
            opt.grads_are_averaged()
        else:
            assert not opt.next_step_averages_exactly
            with pytest.raises(RuntimeError, match="local gradient"):
                opt.grads_are_averaged()
        opt.step()
