"""Dense projections on int8 / int4 (``moebit.inference.quantize_dense``): each
QuantLinear against the plain dequantized product, every dense Linear replaced but the
routers, the whole model's logits within a bound of float32, and the bytes the bandwidth
floor counts for them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moebit.bench import decode_floor as fl
from moebit.inference import qgemv
from moebit.inference.quantize import quantize_experts_
from moebit.inference.quantize_dense import QuantLinear, quantize_dense_

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from moebit.bench.decode import build_folder

    folder = tmp_path_factory.mktemp("tiny")
    build_folder("tiny", folder)
    return folder


@pytest.mark.parametrize("bits", [8, 4])
def test_quant_linear_matches_dequantized_product(bits):
    torch.manual_seed(0)
    lin = nn.Linear(80, 48)  # 80 inputs: int4 pads to 96 (whole groups of 32)
    q = QuantLinear(lin, bits=bits)
    x = torch.randn(3, 5, 80)
    qw = qgemv.quantize_weight(lin.weight, bits, 0 if bits == 8 else 32)
    ref = x.reshape(-1, 80) @ qgemv.dequantize_weight(qw).t() + lin.bias
    y = q(x)
    assert y.shape == (3, 5, 48) and y.dtype == torch.float32
    torch.testing.assert_close(y.reshape(-1, 48), ref, atol=2e-5, rtol=2e-5)
    # the quantization error itself: |w - q s| <= s / 2 per weight, so per output <= sum|x| s/2
    exact = lin(x).reshape(-1, 48)
    s_max = qw.s.amax()
    assert ((y.reshape(-1, 48) - exact).abs() <= x.reshape(-1, 80).abs().sum(1, keepdim=True)
            * s_max / 2 + 1e-5).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_dense_model(tiny_folder, bits):
    from moebit.models.hf import from_pretrained

    ref = from_pretrained(str(tiny_folder)).eval()
    m = from_pretrained(str(tiny_folder)).eval()
    quantize_experts_(m, bits=bits)
    report = quantize_dense_(m, bits=bits)
    layers = ref.config.num_layers
    assert report.layers == 4 * layers + 1  # q, k, v, o per layer and the head
    assert f"int{bits} dense projections" in str(report)
    assert all(isinstance(b.mlp.gate.router, nn.Linear) for b in m.blocks)  # routers stay
    assert isinstance(m.lm_head, QuantLinear) and isinstance(m.blocks[0].self_attn.q_proj,
                                                             QuantLinear)
    # the floor's "_all" scheme counts exactly these bytes
    dims = fl.Dims.of_config(ref.config.hf)
    scheme = fl.SCHEMES[f"moebit_int{bits}_all"]
    attn = sum(getattr(b.self_attn, p).weight_bytes() for b in m.blocks
               for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert attn == fl.weight_bytes(dims, scheme)["attention"]
    assert m.lm_head.weight_bytes() == fl.weight_bytes(dims, scheme)["head"]
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids).logits, m(ids).logits
    rel = float((a - b).norm() / a.norm())
    assert rel < (0.05 if bits == 8 else 0.3), rel
    assert rel > 0  # something was quantized
    with pytest.raises(ValueError, match="no dense nn.Linear"):
        quantize_dense_(nn.Sequential(nn.ReLU()))


def test_quantize_model_scopes(tiny_folder):
    """``--quantize``'s scopes: "all" quantizes the experts and the projections, "experts"
    the experts only; a dense model under "experts" is refused by name, and under "all"
    its projections are quantized."""
    from moebit.inference.quantize import QuantExperts
    from moebit.inference.quantize_dense import quantize_model_
    from moebit.models.gpt import GPT, GPTConfig
    from moebit.models.hf import from_pretrained

    m = from_pretrained(str(tiny_folder)).eval()
    reports = quantize_model_(m, 8, "all")
    assert [type(r).__name__ for r in reports] == ["QuantizeReport", "DenseQuantizeReport"]
    assert isinstance(m.lm_head, QuantLinear)
    assert any(isinstance(x, QuantExperts) for x in m.modules())
    m = from_pretrained(str(tiny_folder)).eval()
    assert len(quantize_model_(m, 4, "experts")) == 1
    assert isinstance(m.lm_head, nn.Linear)
    torch.manual_seed(0)
    dense = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16)).eval()
    with pytest.raises(ValueError, match="--quantize-scope experts: the model is dense"):
        quantize_model_(dense, 8, "experts")
    with pytest.raises(ValueError, match="--quantize-scope must be one of"):
        quantize_model_(dense, 8, "heads")
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = dense(ids).logits
        [report] = quantize_model_(dense, 8, "all")
        got = dense(ids).logits
    assert report.layers == 4 * 2 + 1  # qkv, proj, fc and the MLP's proj per block; the head
    assert sum(isinstance(x, QuantLinear) for x in dense.modules()) == report.layers
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.05, rel


def test_decode_kernels_are_timed_on_streamed_copies():
    """A choice for a few rows is timed over distinct copies of the weight (read from
    memory, as a decode step reads it), a choice for many rows on the weight itself; the
    copies hold their own storage and the same values."""
    from moebit.inference.quantize import DECODE_ROWS, STREAM_BYTES, streamed_copies, tune_key

    qw = qgemv.quantize_weight(torch.randn(256, 1024), 8, 0)
    copies = streamed_copies(qw)
    size = qw.q.numel() + qw.s.numel() * 4
    assert copies[0] is qw and len(copies) == min(256, STREAM_BYTES // size)
    assert len({c.q.data_ptr() for c in copies}) == len(copies)
    assert all(torch.equal(c.q, qw.q) and torch.equal(c.s, qw.s) for c in copies)
    assert len(streamed_copies(qw, total=1)) == 1
    assert "|stream|" in tune_key(qw, DECODE_ROWS, torch.float32)


def test_quant_linear_follows_a_cast_of_its_scales():
    """``model.to(bfloat16)`` after quantizing casts the scales: the next call packs the
    new buffers (the held QWeight is rebuilt) and still matches the float32 product."""
    torch.manual_seed(0)
    q = QuantLinear(nn.Linear(64, 32), bits=8)
    x = torch.randn(2, 64)
    want = q(x)
    q.to(torch.bfloat16)
    assert q.s.dtype == torch.bfloat16
    got = q(x.to(torch.bfloat16)).float()
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    assert q._qw[1] is q.s
