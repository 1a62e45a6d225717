"""int8 experts of every type within their stated per-channel bound (docs/inference.md).

One linear ``y = x @ w (+ b)``, w quantized per output channel n (s_n = max_k |w[k, n]| / 127):

    |y_n - y_ref_n| <= s_n / 2 * sum_k |x_k|                   (rounding of w)
                     + 2^-8 * sum_k |x_k| * |q[k, n]| * s_n     (bf16 rounding of x, int8 kernel)
                     + 2^-8 * |y_n|                               (bf16 rounding of the output)
                     + 1e-5 * (1 + |y_n|)                        (float32 accumulation)

A whole expert: the up linear's error eps goes through the activation (GELU: at most
L * eps; gated act(g) * u: L * eps_g * |u| + |act(g)| * eps_u, L = max |act'|: 1.1 for SiLU,
1.13 for GELU), then through |w_down| (bounded by |dequant(q_down)| + s/2), plus the down
linear's own bound on the input it actually received.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moebit.inference.generate import generate
from moebit.inference.quantize import Int8Experts, dequantize, int8_linear, quantize_experts_, use_int8_kernel
from moebit.models.gpt import GPT, GPTConfig
from moebit.moe import MoEConfig
from moebit.moe.experts import Experts
from moebit.moe.kernels import act_new, is_gated

LIPSCHITZ = {"swiglu": 1.1, "geglu": 1.13, "gelu_mlp": 1.13}  # max |silu'| = 1.0998, |gelu'| = 1.129


pytestmark = pytest.mark.usefixtures("one_thread")


def linear_bound(x, q_NK, s_N, y_ref, bf16: bool) -> torch.Tensor:
    ax = x.abs()
    b = s_N / 2 * ax.sum(1, keepdim=True)
    if bf16:
        b = b + 2.0**-8 * (ax @ (q_NK.float().abs().t() * s_N)) + 2.0**-8 * y_ref.abs()
    return b + 1e-5 * (1 + y_ref.abs())


@torch.no_grad()
def _float_expert(ex: Experts, e: int, x: torch.Tensor):
    """(pre-activation, activation, output) of float expert e on rows x."""
    w_up, b_up, w_down, b_down = ex.projections()
    up, down = (w_up[e].t(), w_down[e].t()) if is_gated(ex.expert_type) else (w_up[e], w_down[e])
    hpre = x @ up + (0 if b_up is None else b_up[e])
    h = act_new(ex.expert_type, hpre)[0]
    return hpre, h, h @ down + (0 if b_down is None else b_down[e])


@torch.no_grad()
def expert_bound(q: Int8Experts, ex: Experts, e: int, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The module docstring's bound for expert e on rows x."""
    hpre_ref, h_ref, y_ref = _float_expert(ex, e, x)
    hpre = int8_linear(x, q.q_up[e], q.s_up[e], None if q.b_up is None else q.b_up[e], q.kernel)
    h = act_new(q.expert_type, hpre)[0]
    eps_up = linear_bound(x, q.q_up[e], q.s_up[e], hpre_ref, bf16)
    lip = LIPSCHITZ[q.expert_type]
    if is_gated(q.expert_type):
        f = q.d_ffn
        act = F.silu if q.expert_type == "swiglu" else F.gelu
        eps_h = lip * eps_up[:, :f] * hpre[:, f:].abs() + act(hpre_ref[:, :f]).abs() * eps_up[:, f:]
    else:
        eps_h = lip * eps_up
    w_down_abs = dequantize(q.q_down[e:e + 1], q.s_down[e:e + 1])[0].abs() + q.s_down[e] / 2
    return eps_h @ w_down_abs + linear_bound(h, q.q_down[e], q.s_down[e], y_ref, bf16)


def _experts(kind: str, bias: bool) -> Experts:
    torch.manual_seed(3)
    ex = Experts(5, 48, 80, expert_type=kind, bias=bias)
    with torch.no_grad():  # output channels of very different scales: per-channel scales matter
        w_up, _, w_down, _ = ex.projections()
        if is_gated(kind):
            w_up.mul_(torch.logspace(-2, 0, w_up.shape[1])[None, :, None])
        else:
            w_up.mul_(torch.logspace(-2, 0, w_up.shape[2])[None, None, :])
    return ex


@pytest.mark.parametrize("kernel", ["auto", "int8", "dequant"])
@pytest.mark.parametrize("kind,bias", [("swiglu", False), ("geglu", False), ("gelu_mlp", True),
                                       ("gelu_mlp", False)])
def test_every_expert_within_its_bound(kind: str, bias: bool, kernel: str) -> None:
    ex = _experts(kind, bias)
    q = Int8Experts(ex, kernel)
    counts = [1, 0, 5, 40, 3]  # blocks on both sides of SMALL_ROWS, an empty expert
    x = torch.randn(sum(counts), 48) * 2
    with torch.no_grad():
        ref = ex(x, counts)
    y = q(x, counts)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    start = 0
    for e, n in enumerate(counts):
        r = slice(start, start + n)
        start += n
        if not n:
            continue
        bound = expert_bound(q, ex, e, x[r], use_int8_kernel(n, kernel))
        err = (y[r] - ref[r]).abs()
        assert (err <= bound).all(), (e, float((err - bound).max()))
    assert (y - ref).abs().max() > 0  # it really is quantized
    assert float((y - ref).norm() / ref.norm()) < 0.02


def test_swiglu_buffers_and_size() -> None:
    ex = _experts("swiglu", False)
    q = Int8Experts(ex)
    d, f = 48, 80
    assert q.q_up.shape == (5, 2 * f, d) and q.q_up.dtype == torch.int8
    assert q.q_down.shape == (5, d, f) and q.b_up is None and q.b_down is None
    before = sum(p.numel() * p.element_size() for p in ex.parameters())
    # 3df float32 weights -> 3df int8 + float32 scales for the 2f + d output channels
    assert before / q.weight_bytes() == pytest.approx(4 * 3 * d * f / (3 * d * f + 4 * (2 * f + d)))
    assert "int8 swiglu experts" in repr(q)


def _gpt(kind: str) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=64, num_experts=4,
                    moe_every=1, moe=MoEConfig(num_experts_per_tok=2, expert_type=kind))
    return GPT(cfg).eval()


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_gated_gpt_quantizes_and_generates(kind: str) -> None:
    m = _gpt(kind)
    x_SD = torch.randn(48, 32)
    with torch.no_grad():
        ref = [b.ffn.infer(x_SD) for b in m.blocks]
    rep = quantize_experts_(m)
    assert rep.layers == 2 and 3.5 < rep.ratio < 4.0
    assert all(isinstance(b.ffn.experts, Int8Experts) for b in m.blocks)
    with torch.no_grad():  # each MoE layer alone (whole-model logits also move by routing flips)
        for b, r in zip(m.blocks, ref, strict=True):
            assert 0 < float((b.ffn.infer(x_SD) - r).norm() / r.norm()) < 0.02
    prompts = ["def ", "import os\n"]
    cached = generate(m, prompts, max_new_tokens=6, temperature=0)
    assert cached == generate(m, prompts, max_new_tokens=6, temperature=0, use_cache=False)
    m.to(torch.bfloat16)  # --dtype bfloat16 after --quantize int8: scales are cast, kernels still run
    assert len(generate(m, prompts[:1], max_new_tokens=4, temperature=0)[0]) > 0
