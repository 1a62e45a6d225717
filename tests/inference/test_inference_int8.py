"""int8 experts: the matmul within its stated bound, 4x smaller weights, same model outputs.

The bound, per output channel n of ``y = x @ w + b`` with w quantized per channel
(scale s_n = max_k |w[k, n]| / 127, q = round(w / s_n)):

    |y_n - y_ref_n| <= s_n / 2 * sum_k |x_k|                  (rounding of w)
                     + 2^-8 * sum_k |x_k| * |q[k, n]| * s_n    (bf16 rounding of x, int8 kernel)
                     + 2^-8 * |y_n|                              (bf16 rounding of the output)
                     + 1e-5 * (1 + |y_n|)                       (float32 accumulation)

The last two bf16 terms apply to the int8 kernel only; the dequantize kernel computes in
the activation dtype (float32 here).
"""

from __future__ import annotations

import pytest
import torch

from moebit.inference.generate import generate
from moebit.inference.quantize import (
    Int8Experts,
    dequantize,
    int8_linear,
    quantize_experts_,
    quantize_per_channel,
)
from moebit.moe.experts import Experts

pytestmark = pytest.mark.usefixtures("one_thread")


def _bound(x: torch.Tensor, q_NK: torch.Tensor, s_N: torch.Tensor, y: torch.Tensor, bf16: bool):
    ax = x.abs()
    b = s_N / 2 * ax.sum(1, keepdim=True)
    if bf16:
        b = b + 2.0**-8 * (ax @ (q_NK.float().abs().t() * s_N)) + 2.0**-8 * y.abs()
    return b + 1e-5 * (1 + y.abs())


@pytest.mark.parametrize("kernel", ["int8", "dequant"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int8_linear_within_bound(kernel: str, rows: int) -> None:
    torch.manual_seed(rows)
    w_KN = torch.randn(1, 96, 160) * torch.logspace(-2, 0, 160)  # channels of very different scale
    b_N = torch.randn(160)
    x = torch.randn(rows, 96)
    q, s = quantize_per_channel(w_KN)
    assert q.dtype == torch.int8 and q.shape == (1, 160, 96)
    assert (dequantize(q, s) - w_KN).abs().le(s[:, None, :] / 2 + 1e-7).all()
    y = int8_linear(x, q[0], s[0], b_N, kernel)
    ref = x @ w_KN[0] + b_N
    err = (y - ref).abs()
    bound = _bound(x, q[0], s[0], ref, kernel == "int8")
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 0  # it really is quantized


def test_int8_experts_match_and_shrink() -> None:
    torch.manual_seed(0)
    ex = Experts(6, 64, 256)
    counts = [3, 30, 0, 1, 17, 9]  # both kernels: blocks below and above SMALL_ROWS
    x = torch.randn(sum(counts), 64)
    with torch.no_grad():
        ref = ex(x, counts)
    q = Int8Experts(ex)
    y = q(x, counts)
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 0.01, rel
    before = sum(p.numel() * p.element_size() for p in ex.parameters())
    # int8 weights plus float32 scales and biases: 4 * (2df + d + f) / (2df + 8 (d + f))
    assert before / q.weight_bytes() == pytest.approx(4 * (2 * 64 * 256 + 320) / (2 * 64 * 256 + 8 * 320))


def test_quantized_model_generates_and_reports() -> None:
    from test_inference_decode import PROMPTS, sharp_model

    m = sharp_model("pr-moe")
    x = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ref = m.eval()(x).logits
    rep = quantize_experts_(m)
    assert rep.layers == 2 and 3.4 < rep.ratio < 4.0
    assert "smaller" in str(rep)
    with torch.no_grad():
        out = m(x).logits
    assert float((out - ref).norm() / ref.norm()) < 0.02
    texts = generate(m, PROMPTS, max_new_tokens=8, temperature=0)
    assert len(texts) == len(PROMPTS)
    m.to(torch.float32)  # a cast touches the scales too; the int8 kernel must still run
    assert generate(m, PROMPTS, max_new_tokens=8, temperature=0) == texts
    assert generate(m.to(torch.bfloat16), PROMPTS[:1], max_new_tokens=4, temperature=0)[0]
    with pytest.raises(ValueError, match="no MoE layer"):
        quantize_experts_(m)  # already int8
    with pytest.raises(ValueError, match="no MoE layer"):
        quantize_experts_(sharp_model("dense"))
