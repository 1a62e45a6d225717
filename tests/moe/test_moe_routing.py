"""Routers beyond GShard: sigmoid scoring, top-k-then-softmax, DeepSeek-V3 groups, scaling,
the selection bias and its update, the sequence-wise loss, and bad configs naming the key."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from moebit.moe import (
    MoE,
    MoEConfig,
    TopKGate,
    group_limited_mask,
    load_imbalance,
    router_metrics,
    seq_load_balancing_loss,
    update_router_biases_,
)


def _logit(p: list[float]) -> list[float]:
    return [math.log(v / (1 - v)) for v in p]


def _sigmoid_gate_on(scores_SE: torch.Tensor, **kw) -> tuple[TopKGate, torch.Tensor]:
    """A sigmoid gate whose scores for tokens x are exactly ``scores_SE`` (router = I)."""
    e = scores_SE.shape[1]
    gate = TopKGate(e, MoEConfig(num_experts=e, scoring_func="sigmoid", drop_tokens=False, **kw))
    with torch.no_grad():
        gate.router.weight.copy_(torch.eye(e))
    return gate, torch.tensor([_logit(row) for row in scores_SE.tolist()])


def test_group_limited_topk_on_a_hand_built_matrix() -> None:
    # 8 experts in 4 groups of 2; a group scores the sum of its two experts.
    scores = torch.tensor([
        [0.90, 0.01, 0.55, 0.45, 0.85, 0.10, 0.20, 0.30],  # groups 0.91 1.00 0.95 0.50
        [0.05, 0.04, 0.30, 0.20, 0.10, 0.15, 0.70, 0.60],  # groups 0.09 0.50 0.25 1.30
    ])
    mask = group_limited_mask(scores, n_group=4, topk_group=2)
    assert mask.tolist() == [
        [False, False, True, True, True, True, False, False],
        [False, False, True, True, False, False, True, True],
    ]
    gate, x = _sigmoid_gate_on(scores, num_experts_per_tok=2, n_group=4, topk_group=2,
                               norm_topk_prob=False)
    r = gate(x)
    # plain top-2 would pick (0, 4) for token 0; the kept groups {1, 2} give (4, 2)
    assert r.expert_SK.tolist() == [[4, 2], [6, 7]]
    assert torch.allclose(r.weight_SK, torch.tensor([[0.85, 0.55], [0.70, 0.60]]), atol=1e-6)
    # groups of one expert score that expert alone
    single = group_limited_mask(scores, n_group=8, topk_group=3)
    assert single[0].nonzero().flatten().tolist() == [0, 2, 4]


def test_sigmoid_norm_topk_prob_scaling_and_bias_equal_a_hand_oracle() -> None:
    torch.manual_seed(0)
    e, k, d = 6, 2, 5
    cfg = MoEConfig.from_dict({"num_experts": e, "k": k, "scoring_func": "sigmoid",
                               "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                               "bias_update_speed": 0.01, "drop_tokens": False})
    gate = TopKGate(d, cfg)
    bias = torch.tensor([0.0, 0.3, -0.2, 0.0, 0.1, -0.5])
    gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(20, d)
    r = gate(x)
    s = torch.sigmoid(x @ gate.router.weight.t())
    for t in range(20):
        order = sorted(range(e), key=lambda i: -(s[t, i] + bias[i]).item())[:k]
        assert r.expert_SK[t].tolist() == order  # selected with the bias ...
        w = s[t, order] / s[t, order].sum() * 2.5  # ... weighted without it
        assert torch.allclose(r.weight_SK[t], w, atol=1e-6)


def test_topk_then_softmax_weights_sum_to_one_at_k1() -> None:
    torch.manual_seed(0)
    gate = TopKGate(8, MoEConfig(num_experts=4, softmax_before_topk=False))
    r = gate(torch.randn(10, 8, requires_grad=True))
    assert torch.equal(r.weight_SK, torch.ones(10, 1))
    gate2 = TopKGate(8, MoEConfig(num_experts=4, num_experts_per_tok=3, softmax_before_topk=False))
    x = torch.randn(10, 8)
    r2 = gate2(x)
    logits = x @ gate2.router.weight.t()
    assert torch.allclose(r2.weight_SK, torch.softmax(logits.gather(1, r2.expert_SK), -1))


def test_bias_update_on_a_hand_built_load() -> None:
    moe = MoE(4, MoEConfig(num_experts=4, bias_update_speed=0.1, d_ffn=8))
    gate = moe.gate
    assert "gate.e_score_correction_bias" in moe.state_dict()
    assert "gate.e_score_correction_bias" not in dict(moe.named_parameters())
    gate.load_since_update.copy_(torch.tensor([5, 1, 3, 3]))  # mean 3
    assert update_router_biases_(moe) == 1
    assert torch.allclose(gate.e_score_correction_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert gate.load_since_update.sum() == 0
    update_router_biases_(moe)  # nothing routed since: the bias stays
    assert torch.allclose(gate.e_score_correction_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    # training forwards count their choices, eval forwards do not
    x = torch.randn(2, 5, 4)
    out = moe(x)
    assert torch.equal(gate.load_since_update, out.stats.tokens_per_expert)
    assert out.stats.score_bias is not None
    moe.eval()
    moe(x)
    assert torch.equal(gate.load_since_update, out.stats.tokens_per_expert)
    m = router_metrics([out.stats])
    assert m["router_bias"] == [pytest.approx([-0.1, 0.1, 0.0, 0.0])]
    assert m["load_max_over_mean"] == [load_imbalance(out.stats.tokens_per_expert)]


def test_bias_balances_a_skewed_router() -> None:
    # A router that sends most tokens to expert 0; the bias alone must spread the load.
    torch.manual_seed(0)
    gate = TopKGate(4, MoEConfig(num_experts=4, bias_update_speed=0.01, drop_tokens=False))
    x = torch.randn(512, 4)
    x[:, 0] = 1.0
    with torch.no_grad():
        gate.router.weight.normal_()
        gate.router.weight[:, 0] = torch.tensor([3.0, 0.0, 0.0, 0.0])
    first = load_imbalance(gate(x).stats.tokens_per_expert)
    for _ in range(300):
        update_router_biases_(gate)
        gate(x)
    last = load_imbalance(gate(x).stats.tokens_per_expert)
    assert first > 2.5 and last < 1.1


def test_seq_aux_loss_against_a_hand_computation() -> None:
    # 2 sequences of 2 tokens, 2 experts, top-1.
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.1, 0.9]])
    expert = torch.tensor([[0], [0], [1], [1]])
    # seq 0: P = (0.7, 0.3), f = (1, 0) -> 2 * 0.7; seq 1: P = (0.2, 0.8), f = (0, 1) -> 2 * 0.8
    assert seq_load_balancing_loss(probs, expert, 2).item() == pytest.approx((1.4 + 1.6) / 2)
    # the batch-wise loss sees a balanced batch: 2 * (0.45 * 0.5 + 0.55 * 0.5) = 1.0
    gate = TopKGate(2, MoEConfig(num_experts=2, seq_aux=True))
    x = torch.randn(3, 4, 2)
    r = gate(x.reshape(-1, 2), seq_len=4)
    _, p, e, _ = gate.choose(x.reshape(-1, 2))
    assert torch.allclose(r.aux_loss, seq_load_balancing_loss(p, e, 4))
    with pytest.raises(ValueError, match="seq_len"):
        seq_load_balancing_loss(p, e, 5)


def _oracle_weights(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor) -> torch.Tensor:
    """Dense [S, E] gate weights (zero off the chosen experts), token by token in Python."""
    s, e = logits.shape
    out = torch.zeros(s, e)
    for t in range(s):
        lt = logits[t]
        if cfg.scoring_func == "sigmoid":
            score = torch.sigmoid(lt)
        else:
            score = torch.softmax(lt, 0) if cfg.softmax_before_topk else lt
        sel = (score + bias).tolist()
        allowed = list(range(e))
        if cfg.n_group > 1 and cfg.topk_group:
            size = e // cfg.n_group
            gscore = [sum(sorted(sel[g * size:(g + 1) * size])[-2:]) for g in range(cfg.n_group)]
            keep = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[: cfg.topk_group]
            allowed = [i for i in allowed if i // size in keep]
        chosen = sorted(allowed, key=lambda i: -sel[i])[: cfg.k]
        w = score[chosen]
        if not cfg.softmax_before_topk:
            w = torch.softmax(w, 0)
        elif cfg.norm_topk_prob and cfg.k > 1:
            w = w / w.sum()
        out[t, chosen] = w * cfg.routed_scaling_factor
    return out


ROUTERS = [
    {},
    {"softmax_before_topk": False},
    {"norm_topk_prob": False},
    {"scoring_func": "sigmoid"},
    {"scoring_func": "sigmoid", "norm_topk_prob": False, "routed_scaling_factor": 2.5},
    {"scoring_func": "sigmoid", "n_group": 4, "topk_group": 2, "bias_update_speed": 1e-3},
    {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 0.5, "bias_update_speed": 1e-3},
]


@pytest.mark.parametrize(("router", "k"), list(itertools.product(ROUTERS, [1, 2, 3])))
def test_every_router_through_the_layer_equals_a_one_hot_oracle(router: dict, k: int) -> None:
    torch.manual_seed(k)
    e, d = 8, 6
    cfg = MoEConfig(num_experts=e, num_experts_per_tok=k, drop_tokens=False, d_ffn=10, **router)
    moe = MoE(d, cfg)
    bias = torch.zeros(e)
    if moe.gate.e_score_correction_bias is not None:
        bias = torch.randn(e) * 0.05
        moe.gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(3, 7, d, requires_grad=True)
    out = moe(x).hidden
    g_out = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *moe.parameters()], g_out)

    x_SD = x.reshape(-1, d)
    logits = x_SD @ moe.gate.router.weight.t()
    w_SE = _oracle_weights(logits, cfg, bias)
    per_expert = [moe.experts(x_SD, [x_SD.shape[0] if j == i else 0 for j in range(e)])
                  for i in range(e)]  # every token through expert i
    oracle = sum(w_SE[:, i:i + 1] * per_expert[i] for i in range(e)).view_as(out)
    want = torch.autograd.grad(oracle, [x, *moe.parameters()], g_out)
    assert torch.allclose(out, oracle, atol=1e-5)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(("settings", "key"), [
    ({"num_experts": 8, "n_group": 3}, "n_group"),
    ({"num_experts": 8, "n_group": 4, "topk_group": 5}, "topk_group"),
    ({"num_experts": 8, "n_group": 4, "topk_group": 1, "k": 3}, "num_experts_per_tok"),
    ({"num_experts": 8, "scoring_func": "relu"}, "scoring_func"),
    ({"num_experts": 8, "routed_scaling_factor": 0}, "routed_scaling_factor"),
    ({"num_experts": 8, "bias_update_speed": -1e-3}, "bias_update_speed"),
    ({"num_experts": 8, "scoring_func": "sigmoid", "softmax_before_topk": False},
     "softmax_before_topk"),
    ({"num_experts": 8, "moe_router_load_balancing_type": "sinkhorn"},
     "moe_router_load_balancing_type"),
])
def test_bad_routing_configs_name_the_key(settings: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        MoEConfig.from_dict(settings)


def test_megatron_and_deepseek_aliases() -> None:
    c = MoEConfig.from_dict({
        "moe_num_experts": 8, "moe_router_score_function": "sigmoid", "moe_router_num_groups": 4,
        "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5,
        "moe_router_bias_update_rate": 1e-3, "moe_router_load_balancing_type": "seq_aux_loss",
        "aux_loss_alpha": 1e-4, "moe_router_pre_softmax": True, "norm_topk_prob": False,
    })
    assert (c.scoring_func, c.n_group, c.topk_group, c.routed_scaling_factor) == (
        "sigmoid", 4, 2, 2.5)
    assert c.bias_update_speed == 1e-3 and c.seq_aux and c.router_aux_loss_coef == 1e-4
    assert c.norm_topk_prob is False
    with pytest.raises(ValueError, match="twice"):
        MoEConfig.from_dict({"n_group": 2, "moe_router_num_groups": 2})


def test_train_config_keys_reach_the_layers_and_defaults_leave_the_model_config_alone() -> None:
    from moebit.checkpoint import CheckpointError
    from moebit.models.gpt import moe_config_for
    from moebit.training.config import ConfigError, build
    from moebit.training.state import check_model_config

    # A manifest written before the routing keys existed still matches a default-routed run.
    old = {"vocab_size": 256, "block_size": 256, "n_layer": 4, "n_head": 4, "d_model": 256,
           "d_ffn": 1024, "dropout": 0.0, "num_experts": 8, "moe_every": 2,
           "moe": {"num_experts_per_tok": 1, "residual": False, "capacity_factor": 1.0,
                   "eval_capacity_factor": 1.0, "drop_tokens": True, "router_aux_loss_coef": 0.01,
                   "router_z_loss_coef": 0.0, "ep_size": 1}}
    now = build({"num_experts": 8}).model_config().to_dict()
    check_model_config({"model_config": old}, now, Path("step-1"))
    with pytest.raises(CheckpointError, match="scoring_func"):
        sig = build({"num_experts": 8, "scoring_func": "sigmoid"}).model_config().to_dict()
        check_model_config({"model_config": old}, sig, Path("step-1"))
    cfg = build({"num_experts": 8, "num_experts_per_tok": 2, "scoring_func": "sigmoid",
                 "norm_topk_prob": "false", "n_group": 4, "topk_group": 2,
                 "routed_scaling_factor": 2.5, "bias_update_speed": 1e-3, "seq_aux": True})
    m = moe_config_for(cfg.model_config(), 1)
    assert (m.scoring_func, m.norm_topk_prob, m.n_group, m.topk_group) == ("sigmoid", False, 4, 2)
    assert (m.routed_scaling_factor, m.bias_update_speed, m.seq_aux) == (2.5, 1e-3, True)
    with pytest.raises(ConfigError, match="topk_group"):
        build({"num_experts": 8, "n_group": 2, "topk_group": 3})


def test_rsample_noise_picks_but_weights_stay_plain_scores() -> None:
    torch.manual_seed(0)
    gate = TopKGate(6, MoEConfig(num_experts=8, num_experts_per_tok=3, scoring_func="sigmoid",
                                 noise="rsample", norm_topk_prob=False,
                                 bias_update_speed=1e-3, n_group=4, topk_group=2))
    x = torch.randn(200, 6)
    r = gate(x)
    s = torch.sigmoid(x @ gate.router.weight.t())
    assert torch.allclose(r.weight_SK, s.gather(1, r.expert_SK))
    gate.eval()  # no noise: the plain top-k inside the kept groups
    assert not torch.equal(gate(x).expert_SK, r.expert_SK)
    groups = r.expert_SK // 2  # 3 experts, yet at most 2 groups per token, noise or not
    assert all(len(set(g)) <= 2 for g in groups.tolist())
