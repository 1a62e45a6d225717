"""int4 / int8 experts on the native kernels: close to float, smaller, and auto's choice
among the kernels measured and cached."""

from __future__ import annotations

import json

import pytest
import torch

from moebit.inference import qgemv
from moebit.inference.quantize import QuantExperts, candidates, quant_linear, quantize_experts_, tune_key
from moebit.moe import autotune
from moebit.moe.experts import Experts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["swiglu", "gelu_mlp"])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 0), (8, 32)])
def test_quantized_experts_close_to_float_on_native_and_dequant(kind, bits, group):
    torch.manual_seed(1)
    ex = Experts(4, 64, 96, expert_type=kind)
    counts = [1, 0, 3, 20]
    x = torch.randn(sum(counts), 64)
    with torch.no_grad():
        ref = ex(x, counts)
    outs = {}
    for kernel in ("native", "dequant"):
        q = QuantExperts(ex, kernel, bits, group)
        outs[kernel] = q(x, counts)
        rel = float((outs[kernel] - ref).norm() / ref.norm())
        # int4 (steps of max|w| / 7) on uniform weights: ~0.07 a linear, ~0.12 an expert
        assert 0 < rel < (0.2 if bits == 4 else 0.01), (kernel, rel)
    # the same quantized weights: the kernels differ only in summation order
    assert torch.allclose(outs["native"], outs["dequant"], atol=1e-4, rtol=1e-4)


def test_int4_shrinks_experts_about_seven_times():
    torch.manual_seed(0)
    m = torch.nn.Module()
    from moebit.moe import MoE, MoEConfig
    m.moe = MoE(128, MoEConfig(num_experts=4, num_experts_per_tok=2, d_ffn=256))
    rep = quantize_experts_(m, bits=4)
    assert rep.bits == 4 and str(rep).startswith("int4 experts: 1 MoE layers")
    # 4 bits a weight plus a float32 scale per 32: 32 / (4 + 1) = 6.4x, biases aside
    assert 6.0 < rep.ratio < 6.5, rep.ratio
    q = m.moe.experts
    assert q.q_up.dtype == torch.uint8 and q.s_up.shape == (4, 256, 4)


def test_bad_kernel_and_layout_combinations_fail_clearly():
    ex = Experts(2, 32, 64, expert_type="swiglu")
    with pytest.raises(ValueError, match="kernel 'int8' needs bits=8"):
        QuantExperts(ex, "int8", bits=4)
    with pytest.raises(ValueError, match="kernel must be one of"):
        QuantExperts(ex, "fast")
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantExperts(ex, bits=4, group=40)


def test_auto_measures_the_candidates_once_and_caches_the_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBIT_AUTOTUNE", "1")
    monkeypatch.setenv("MOEBIT_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
    autotune.reset()
    try:
        qw = qgemv.quantize_weight(torch.randn(96, 64), 8, 0)
        x = torch.randn(3, 64)
        y = quant_linear(x, qw, None, "auto")
        key = tune_key(qw, 3, torch.float32)
        entry = json.loads((tmp_path / "tune.json").read_text())[autotune.machine_key()][key]
        assert entry["choice"] in candidates(qw)
        assert set(entry["times_s"]) == set(candidates(qw))
        assert "dequant" in entry["times_s"]
        # 4 rows share the bucket of 3: the cached choice, no new entry
        quant_linear(torch.randn(4, 64), qw, None, "auto")
        data = json.loads((tmp_path / "tune.json").read_text())[autotune.machine_key()]
        assert list(data) == [key]
        ref = x @ qgemv.dequantize_weight(qw).t()
        assert float((y - ref).norm() / ref.norm()) < 0.01  # bf16 activations at worst
    finally:
        autotune.reset()
