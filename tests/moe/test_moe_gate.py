"""TopKGate: capacity, dropping on hand-built routings, losses on known inputs, noise, stats."""

from __future__ import annotations

import math

import pytest
import torch

from moebit.moe import (
    MoEConfig,
    TopKGate,
    compute_capacity,
    load_balancing_loss,
    router_z_loss,
    select_kept,
)


def test_capacity_formula_min_and_clamp() -> None:
    assert compute_capacity(100, 8, 2, 1.0, 4) == math.ceil(2 * 100 / 8)  # 25
    assert compute_capacity(100, 8, 1, 1.25, 4) == math.ceil(1.25 * 100 / 8)  # 16
    assert compute_capacity(10, 64, 1, 1.0, 4) == 4  # min_capacity wins
    assert compute_capacity(3, 64, 1, 1.0, 4) == 3  # never more than S
    assert compute_capacity(16, 2, 2, 4.0, 4) == 16  # k*cf > E: clamped to S


def test_position_policy_keeps_first_choices_before_second() -> None:
    # 4 tokens, top-2, capacity 2 per expert, experts {0, 1, 2}.
    expert_SK = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 1]])
    kept = select_kept(expert_SK, 3, capacity=2, policy="position")
    # expert 0: first choices of tokens 0, 2, 3 (only 0 and 2 fit), second choice of 1 lost
    # expert 1: first choice of token 1, then second choices of 0 and 3: only token 0's fits
    # expert 2: second choice of token 2 fits
    expected = torch.tensor([[True, True], [True, False], [True, True], [False, False]])
    assert torch.equal(kept, expected)


def test_random_policy_first_choices_still_win_and_order_is_random() -> None:
    s, e = 64, 2
    expert_SK = torch.stack([torch.zeros(s, dtype=torch.long), torch.ones(s, dtype=torch.long)], 1)
    expert_SK[s // 2 :] = expert_SK[s // 2 :].flip(1)  # half first-choose 0, half first-choose 1
    cap = s // 2
    seen = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        kept = select_kept(expert_SK, e, capacity=cap, policy="random", generator=g)
        # every first choice fits exactly (32 per expert), so every second choice is dropped
        assert kept[:, 0].all() and not kept[:, 1].any()
        seen.append(kept)
    # capacity below the first-choice demand: which ones survive depends on the draw
    winners = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        kept = select_kept(expert_SK, e, capacity=8, policy="random", generator=g)
        assert kept[:, 1].sum() == 0 and kept[: s // 2, 0].sum() == 8
        assert kept[s // 2 :, 0].sum() == 8
        winners.append(kept[:, 0].nonzero().flatten().tolist())
    assert winners[0] != winners[1] or winners[1] != winners[2]
    pos = select_kept(expert_SK, e, capacity=8, policy="position")
    assert pos[:8, 0].all() and not pos[8 : s // 2, 0].any()


def test_rts_keeps_late_tokens_sometimes() -> None:
    s = 200
    expert_SK = torch.zeros(s, 1, dtype=torch.long)
    kept = select_kept(expert_SK, 4, capacity=50, policy="random",
                       generator=torch.Generator().manual_seed(1))
    assert kept.sum() == 50 and kept[100:].any()


def test_load_balancing_loss_on_known_input() -> None:
    probs_SE = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]])
    expert_SK = torch.tensor([[0, 1], [1, 2], [0, 1], [2, 1]])
    mean_p = probs_SE.mean(0)  # [0.375, 0.3375, 0.2875]
    frac = torch.tensor([2, 4, 2]) / 8.0
    expected = 3 * float((mean_p * frac).sum())
    got = load_balancing_loss(probs_SE, expert_SK)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(3 * (0.375 * 0.25 + 0.3375 * 0.5 + 0.2875 * 0.25))
    uniform = torch.full((6, 3), 1 / 3)
    assert load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [0], [1], [2]])).item() == (
        pytest.approx(1.0)
    )


def test_z_loss_on_known_input() -> None:
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-6)


def _gate(**kw) -> TopKGate:
    torch.manual_seed(0)
    return TopKGate(16, MoEConfig(num_experts=8, **kw))


def test_gate_outputs_and_stats() -> None:
    gate = _gate(num_experts_per_tok=2, capacity_factor=1.0)
    x = torch.randn(64, 16)
    r = gate(x)
    assert r.expert_SK.shape == (64, 2) and r.weight_SK.shape == (64, 2)
    assert r.weight_SK.dtype == torch.float32
    assert torch.allclose(r.weight_SK.sum(-1), torch.ones(64))  # normalised top-2
    assert (r.expert_SK[:, 0] != r.expert_SK[:, 1]).all()
    cap = compute_capacity(64, 8, 2, 1.0, 4)
    assert r.stats.capacity == cap
    assert int(r.stats.tokens_per_expert.sum()) == 128
    assert (r.stats.kept_per_expert <= cap).all()
    assert int(r.stats.kept_per_expert.sum()) == int(r.kept_SK.sum())
    dropped = 1 - r.kept_SK.float().mean()
    assert r.stats.fraction_dropped.item() == pytest.approx(dropped.item())
    d = r.stats.to_dict()
    assert d["capacity"] == cap and len(d["tokens_per_expert"]) == 8


def test_unnormalised_weights_are_router_probabilities() -> None:
    gate = _gate(num_experts_per_tok=2, norm_topk_prob=False)
    x = torch.randn(32, 16)
    r = gate(x)
    probs = torch.softmax(x @ gate.router.weight.t(), -1)
    assert torch.allclose(r.weight_SK, probs.gather(1, r.expert_SK), atol=1e-6)


def test_eval_capacity_factor_and_dropless() -> None:
    gate = _gate(capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0)
    assert gate.capacity(800) == 100
    gate.eval()
    assert gate.capacity(800) == 200
    dropless = _gate(drop_tokens=False)
    r = dropless(torch.randn(50, 16))
    assert r.kept_SK.all() and r.stats.capacity is None and r.stats.fraction_dropped == 0


def test_router_runs_in_float32_under_bf16_autocast() -> None:
    gate = _gate(num_experts_per_tok=2)
    x = torch.randn(32, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = gate(x.bfloat16())
    assert r.weight_SK.dtype == torch.float32 and r.aux_loss.dtype == torch.float32
    ref = gate(x.bfloat16().float())
    assert torch.equal(r.expert_SK, ref.expert_SK)
    assert torch.allclose(r.weight_SK, ref.weight_SK)


@pytest.mark.parametrize("noise", ["jitter", "rsample"])
def test_noise_only_in_training(noise: str) -> None:
    gate = _gate(noise=noise, num_experts_per_tok=2)
    x = torch.randn(256, 16)
    gate.eval()
    a, b = gate(x), gate(x)
    assert torch.equal(a.expert_SK, b.expert_SK) and torch.equal(a.weight_SK, b.weight_SK)
    gate.train()
    c = gate(x)
    assert not torch.equal(c.expert_SK, a.expert_SK) or not torch.equal(c.weight_SK, a.weight_SK)
    if noise == "rsample":  # noise picks; the weights stay the clean probabilities
        probs = torch.softmax(x @ gate.router.weight.t(), -1)
        w = probs.gather(1, c.expert_SK)
        assert torch.allclose(c.weight_SK, w / w.sum(-1, keepdim=True), atol=1e-6)


def test_losses_carry_router_gradients() -> None:
    gate = _gate(num_experts_per_tok=2)
    r = gate(torch.randn(32, 16))
    (r.aux_loss + r.z_loss).backward()
    assert gate.router.weight.grad is not None and gate.router.weight.grad.abs().sum() > 0
