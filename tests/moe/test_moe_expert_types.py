"""Every expert type on every kernel against the per-expert oracle (moe_oracles.py),
outputs and gradients, k in {1, 2, 3}, dropping and dropless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_oracles import expert_fn, expert_oracle  # tests/moe/moe_oracles.py

from moebit.moe import MoE, MoEConfig
from moebit.moe.experts import Experts
from moebit.moe.glu import ClampedSwiGLU

TYPES = [("gelu_mlp", True), ("gelu_mlp", False), ("swiglu", False), ("geglu", False)]
KERNELS = ["loop", "padded", "grouped", "threaded"]


def _named_grads(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"x": x.grad.clone()}
    out.update({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    return out


@pytest.mark.parametrize(("expert_type", "bias"), TYPES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [True, False])
def test_expert_types_match_per_expert_oracle(expert_type, bias, kernel, k, drop) -> None:
    torch.manual_seed(k)
    cfg = MoEConfig(num_experts=6, num_experts_per_tok=k, capacity_factor=0.6,
                    drop_tokens=drop, min_capacity=1, d_ffn=24, expert_type=expert_type,
                    expert_bias=bias, kernel=kernel)
    moe = MoE(12, cfg)
    x = torch.randn(3, 20, 12, requires_grad=True)
    proj = torch.randn(3, 20, 12)
    out = moe(x)
    (out.hidden * proj).sum().backward()
    ours, our_grads = out.hidden.detach(), _named_grads(moe, x)
    assert out.stats.fraction_dropped > 0.1 if drop else out.stats.fraction_dropped == 0
    assert len(our_grads) == len(list(moe.parameters())) + 1  # every parameter got a gradient

    moe.zero_grad()
    x.grad = None
    routing = moe.gate(x.reshape(-1, 12))
    ref = expert_oracle(x.reshape(-1, 12), routing, moe.experts).view_as(x)
    (ref * proj).sum().backward()
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-4)
    for name, g in _named_grads(moe, x).items():
        assert torch.allclose(our_grads[name], g, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize(("expert_type", "bias"), TYPES)
@pytest.mark.parametrize(
    ("counts", "d", "f", "dtype"),
    [([5, 0, 7, 1], 12, 24, torch.float32),  # an empty expert
     ([0, 0, 0, 0], 12, 24, torch.float32),  # no rows at all
     ([3, 4, 0, 6], 10, 7, torch.float32),  # widths off grouped_mm's 16-byte rule: padded
     ([6, 2, 5, 0], 12, 20, torch.bfloat16)],  # 24-byte bf16 rows: padded as well
)
def test_kernels_agree_on_empty_groups_and_odd_widths(expert_type, bias, counts, d, f, dtype):
    torch.manual_seed(0)
    ex = Experts(4, d, f, expert_type=expert_type, bias=bias).to(dtype)
    x = torch.randn(sum(counts), d).to(dtype).requires_grad_(True)
    g = torch.randn(sum(counts), d).to(dtype)
    results = {}
    for kernel in KERNELS:
        ex.kernel = kernel
        ex.zero_grad()
        x.grad = None
        y = ex(x, counts)
        (y.float() * g.float()).sum().backward()
        results[kernel] = [y.detach().float(), x.grad.float()] + [p.grad.float() for p in ex.parameters()]
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for kernel in ("padded", "grouped", "threaded"):
        for a, b in zip(results["loop"], results[kernel], strict=True):
            assert torch.allclose(a, b, **tol), kernel
    for e, n in enumerate(counts):
        if n == 0:
            assert all((p.grad[e] == 0).all() for p in ex.parameters())
    if sum(counts):  # the oracle as well, in float32
        start, ref = 0, []
        for e, n in enumerate(counts):
            ref.append(expert_fn(ex, e, x[start:start + n].detach()).float())
            start += n
        assert torch.allclose(results["loop"][0], torch.cat(ref), **tol)


def test_gated_layout_is_hugging_face_fused() -> None:
    """gate_up_proj [E, 2f, d] with the gate rows first, down_proj [E, d, f], no biases."""
    ex = Experts(3, 8, 5, expert_type="swiglu")
    assert dict((n, tuple(p.shape)) for n, p in ex.named_parameters()) == {
        "gate_up_proj": (3, 10, 8), "down_proj": (3, 8, 5)}
    assert all(getattr(p, "moebit_expert", False) for p in ex.parameters())
    x = torch.randn(4, 8)
    with torch.no_grad():
        gate, up = F.linear(x, ex.gate_up_proj[1]).chunk(2, dim=-1)  # Mixtral's own formula
        want = F.linear(F.silu(gate) * up, ex.down_proj[1])
        assert torch.allclose(ex(x, [0, 4, 0]), want, atol=1e-6)
    nobias = Experts(3, 8, 5, bias=False)
    assert {n for n, _ in nobias.named_parameters()} == {"w1", "w2"}
    assert nobias.b1 is None


def test_experts_init_is_rank_independent_for_every_type() -> None:
    for expert_type in ("gelu_mlp", "swiglu"):
        torch.manual_seed(3)
        full = Experts(4, 8, 6, expert_type=expert_type)
        torch.manual_seed(3)
        part = Experts(4, 8, 6, first_expert=2, num_local=2, expert_type=expert_type)
        for (name, a), b in zip(full.named_parameters(), part.parameters(), strict=True):
            assert torch.equal(a[2:], b), name


def test_auto_kernel_candidates_and_grouped_errors() -> None:
    ex = Experts(4, 8, 16, expert_type="swiglu")
    # untuned (MOEBIT_AUTOTUNE=0 in tests): the loop, whatever the blocks
    for counts in ([10, 10, 9, 10], [400, 400, 400, 400], [40, 1, 1, 1], [0, 0, 0, 0]):
        assert ex.choose_kernel(counts, threads=2) == "loop"
    # auto's candidates: padding only within pad_limit, threads only with >1 busy expert
    assert ex.candidates([10, 10, 9, 10], threads=1)[:2] == ["loop", "padded"]
    assert "padded" not in ex.candidates([40, 1, 1, 1], threads=1)
    assert "threaded" in ex.candidates([300, 1, 0, 1], threads=4)
    assert "threaded" not in ex.candidates([300, 0, 0, 0], threads=4)
    assert "threaded" not in ex.candidates([100, 100, 90, 100], threads=1)
    ex.kernel = "grouped"
    assert ex.choose_kernel([40, 1, 0, 1]) == "grouped"
    with pytest.raises(ValueError, match="kernel = 'grouped'"):
        ex.choose_kernel([1, 1, 1, 1], "cpu", torch.float64)  # no float64 grouped_mm on CPU
    ex.kernel = "fast"
    with pytest.raises(ValueError, match="Experts.kernel"):
        ex.choose_kernel([1, 1, 1, 1])
    with pytest.raises(ValueError, match="clamped SwiGLU"):
        Experts(4, 8, 16, expert_type="geglu", act=ClampedSwiGLU(1.702, 7.0, 1.0))
    with pytest.raises(ValueError, match="expert_type"):
        Experts(4, 8, 16, expert_type="relu")


@pytest.mark.parametrize("expert_type", ["gelu_mlp", "swiglu"])
def test_bfloat16_autocast_for_every_type(expert_type: str) -> None:
    torch.manual_seed(0)
    moe = MoE(32, MoEConfig(num_experts=4, num_experts_per_tok=2, drop_tokens=False,
                            expert_type=expert_type, num_shared_experts=1))
    x = torch.randn(64, 32)
    ref = moe(x).hidden
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = moe(x).hidden
    assert auto.dtype == torch.bfloat16
    assert ((auto.float() - ref).norm() / ref.norm()) < 0.03


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference"])
def test_threaded_kernel_on_two_threads_matches_loop(mode) -> None:
    """Experts spread over 2 worker threads: the loop's results (to float rounding: MKL
    splits a GEMM differently on 1 and 2 threads), under grad, no_grad and inference mode."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    ex = Experts(5, 16, 24, expert_type="swiglu")
    counts = [9, 0, 30, 4, 17]
    x = torch.randn(sum(counts), 16, requires_grad=mode == "train")
    results = {}
    try:
        torch.set_num_threads(2)
        for kernel in ("loop", "threaded"):
            ex.kernel = kernel
            ex.zero_grad()
            if mode == "train":
                y = ex(x, counts)
                y.square().sum().backward()
                results[kernel] = [y.detach(), x.grad.clone()] + [p.grad for p in ex.parameters()]
                x.grad = None
            else:
                ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
                with ctx:
                    results[kernel] = [ex(x, counts).clone()]
        assert torch.get_num_threads() == 2  # restored after the workers ran
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(results["loop"], results["threaded"], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)

