"""Sort-based dispatch against the GShard one-hot einsum oracle, outputs and gradients.

The oracle builds the [S, E, C] dispatch and combine tensors that src/ never builds,
runs every expert on its padded capacity buffer with bmm, and combines with an einsum.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moebit.moe import MoE, MoEConfig, Routing
from moebit.moe.experts import Experts


def onehot_oracle(x_SD: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
    """GShard-style MoE output for a given routing (the test-only reference)."""
    s, k = routing.expert_SK.shape
    e = experts.num_local
    pair_e = routing.expert_SK.reshape(-1)
    pair_kept = routing.kept_SK.reshape(-1)
    mask_PE = F.one_hot(pair_e, e) * pair_kept.unsqueeze(1)
    slot_P = ((mask_PE.cumsum(0) - 1) * mask_PE).sum(1)  # slot of each pair in its expert
    cap = max(int(mask_PE.sum(0).max()), 1)
    dispatch_SEC = torch.zeros(s, e, cap)
    combine_SEC = torch.zeros(s, e, cap)
    tok = torch.arange(s).repeat_interleave(k)
    kept = pair_kept.nonzero().flatten()
    idx = (tok[kept], pair_e[kept], slot_P[kept])
    dispatch_SEC = dispatch_SEC.index_put(idx, torch.ones(len(kept)))
    combine_SEC = combine_SEC.index_put(idx, routing.weight_SK.reshape(-1)[kept])
    x_ECD = torch.einsum("sec,sd->ecd", dispatch_SEC, x_SD)
    h_ECF = F.gelu(torch.baddbmm(experts.b1.unsqueeze(1), x_ECD, experts.w1))
    y_ECD = torch.baddbmm(experts.b2.unsqueeze(1), h_ECF, experts.w2)
    return torch.einsum("sec,ecd->sd", combine_SEC, y_ECD)


def _grads(moe: MoE, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in moe.parameters()]


@pytest.mark.parametrize("kernel", ["loop", "padded"])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [True, False])
def test_dispatch_matches_onehot_oracle(k: int, drop: bool, kernel: str) -> None:
    torch.manual_seed(k)
    cfg = MoEConfig(num_experts=6, num_experts_per_tok=k, capacity_factor=0.6,
                    drop_tokens=drop, min_capacity=1, d_ffn=24)
    moe = MoE(12, cfg)
    moe.experts.kernel = kernel
    x = torch.randn(3, 20, 12, requires_grad=True)
    proj = torch.randn(3, 20, 12)

    out = moe(x)
    (out.hidden * proj).sum().backward()
    ours, our_grads = out.hidden.detach(), [g.clone() for g in _grads(moe, x)]
    if drop:
        assert out.stats.fraction_dropped > 0.1  # the case must really drop tokens
    else:
        assert out.stats.fraction_dropped == 0

    moe.zero_grad()
    x.grad = None
    routing = moe.gate(x.reshape(-1, 12))
    ref = onehot_oracle(x.reshape(-1, 12), routing, moe.experts).view_as(x)
    (ref * proj).sum().backward()
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-4)
    for name, a, b in zip(["x"] + [n for n, _ in moe.named_parameters()], our_grads,
                          _grads(moe, x), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), name


def test_dropped_tokens_get_zero_output() -> None:
    torch.manual_seed(0)
    moe = MoE(8, MoEConfig(num_experts=2, capacity_factor=0.25, min_capacity=1))
    x = torch.randn(40, 8)
    out = moe(x)
    routing = moe.gate(x)
    dropped = ~routing.kept_SK[:, 0]
    assert dropped.any()
    assert (out.hidden[dropped] == 0).all() and (out.hidden[~dropped] != 0).any(1).all()


def _peak_rss_delta_mb(fn) -> float:
    """Peak resident memory added while ``fn`` runs (Linux VmHWM reset via clear_refs)."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS on this system")

    def read(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    base = read("VmRSS:")
    fn()
    return (read("VmHWM:") - base) / 1024


@pytest.mark.parametrize("drop", [True, False])
def test_all_tokens_to_one_expert(drop: bool) -> None:
    torch.manual_seed(0)
    s, d, e = 16384, 32, 64
    cfg = MoEConfig(num_experts=e, num_experts_per_tok=1, drop_tokens=drop, d_ffn=32)
    moe = MoE(d, cfg)
    with torch.no_grad():
        moe.gate.router.weight.zero_()
        moe.gate.router.weight[3, 0] = 20.0
    x = torch.randn(s, d)
    x[:, 0] = 1.0
    x.requires_grad_(True)

    result = {}

    def run() -> None:
        out = moe(x)
        out.hidden.sum().backward()
        result["out"] = out

    # A one-hot [S, E, C] buffer here would be 16384 * 64 * 16384 * 4 B = 64 GiB.
    grown = _peak_rss_delta_mb(run)
    assert grown < 300, f"peak memory grew by {grown:.0f} MB"
    out = result["out"]
    assert out.stats.tokens_per_expert[3] == s
    assert torch.isfinite(out.hidden).all() and torch.isfinite(x.grad).all()
    if drop:
        cap = out.stats.capacity
        assert cap == s // e and int(out.stats.kept_per_expert[3]) == cap
        assert out.stats.fraction_dropped.item() == pytest.approx(1 - cap / s)
        assert int((out.hidden.abs().sum(1) > 0).sum()) == cap
    else:
        assert out.stats.fraction_dropped == 0
        assert (out.hidden.abs().sum(1) > 0).all()


def test_bfloat16_weights_and_autocast_match_float32() -> None:
    torch.manual_seed(0)
    moe = MoE(32, MoEConfig(num_experts=4, num_experts_per_tok=2, drop_tokens=False))
    x = torch.randn(64, 32)
    ref = moe(x).hidden
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = moe(x).hidden
    assert auto.dtype == torch.bfloat16
    moe_bf16 = moe.to(torch.bfloat16)
    out_bf16 = moe_bf16(x.bfloat16())
    assert out_bf16.hidden.dtype == torch.bfloat16
    for y in (auto.float(), out_bf16.hidden.float()):
        err = (y - ref).norm() / ref.norm()
        assert err < 0.03, float(err)
    out_bf16.hidden.float().sum().backward()
    assert moe_bf16.experts.w1.grad.dtype == torch.bfloat16


def test_padded_kernel_only_when_blocks_are_nearly_equal() -> None:
    ex = Experts(4, 8, 16)
    assert "padded" in ex.candidates([10, 10, 9, 10])  # 40 padded rows for 39: within 25%
    assert "padded" not in ex.candidates([40, 1, 1, 1])  # 160 padded rows for 43
    assert not ex._use_padded([10, 10, 9, 10])  # auto without tuning data: the loop
    assert not ex._use_padded([0, 0, 0, 0])
    ex.kernel = "loop"
    assert not ex._use_padded([10, 10, 10, 10])
    ex.kernel = "padded"
    assert ex._use_padded([40, 1, 0, 1])
    ex.kernel = "fast"
    with pytest.raises(ValueError, match="Experts.kernel"):
        ex._use_padded([1, 1, 1, 1])


def test_padded_kernel_with_full_blocks_and_empty_experts() -> None:
    """Equal blocks take the no-copy view path; an empty expert gets zero gradients."""
    torch.manual_seed(0)
    for counts in ([5, 5, 5], [6, 0, 4]):
        ex = Experts(3, 8, 16)
        x = torch.randn(sum(counts), 8, requires_grad=True)
        g = torch.randn(sum(counts), 8)
        grads = {}
        for kernel in ("loop", "padded"):
            ex.kernel = kernel
            ex.zero_grad()
            x.grad = None
            y = ex(x, counts)
            (y * g).sum().backward()
            grads[kernel] = [y.detach(), x.grad] + [p.grad.clone() for p in ex.parameters()]
        for a, b in zip(grads["loop"], grads["padded"], strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
        if counts[1] == 0:
            assert (ex.w1.grad[1] == 0).all() and (ex.b2.grad[1] == 0).all()
