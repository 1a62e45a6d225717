"""Weight-only int8 / int4 GEMV-GEMM: every ISA level this CPU runs against the torch
reference, the quantization error bounds against float32, and the fallbacks."""

from __future__ import annotations

import pytest
import torch

from moebit.comm import _native
from moebit.inference import _qgemv_c, qgemv

LEVELS = ["portable", "avx2", "avx512"]
ISA_CODE = {"portable": 0, "avx2": 1, "avx512": 2}
# (bits, group): per channel, groups that divide K or not, int8 groups off the 32 grid
LAYOUTS = [(8, 0), (8, 64), (8, 48), (4, 32), (4, 64), (4, 0)]
SHAPES = [(40, 70), (64, 512), (17, 33), (1, 256)]


def _level(isa: str) -> None:
    if not _native.native_enabled():
        pytest.skip("native kernels are off here (MOEBIT_NATIVE=0 or not Linux)")
    if isa not in _native.supported_isas():
        pytest.skip(f"this CPU cannot run {isa} code (runs {_native.supported_isas()})")
    if _qgemv_c.load(isa) is None:
        pytest.skip("the GEMV kernels do not build here (no gcc with OpenMP)")


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, ::7] *= 5.0  # uneven magnitudes: groups get different scales
    w[0] = 0.0  # an all-zero row: scale 0 must give zeros, not NaN
    return w


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("bits,group", LAYOUTS)
def test_native_kernel_equals_the_reference_at_every_level(isa, bits, group):
    _level(isa)
    assert _qgemv_c.load(isa).qg_isa() == ISA_CODE[isa]
    for n, k in SHAPES:
        qw = qgemv.quantize_weight(_weights(n, k), bits, group)
        for rows in (1, 3, 4, 8, 9, 16):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            y = qgemv.qgemm(x, qw, isa=isa, threads=1)
            ref = qgemv.qgemm_reference(x, qw)
            assert y.shape == (rows, n) and y.dtype == torch.float32
            # same products, another summation order
            tol = 1e-5 * (x.abs() @ dequant_abs(qw).t()) + 1e-6
            assert bool(((y - ref).abs() <= tol).all()), (isa, bits, group, n, k, rows)
            assert torch.equal(y[:, 0], torch.zeros(rows))


def dequant_abs(qw: qgemv.QWeight) -> torch.Tensor:
    return qgemv.dequantize_weight(qw).abs()


@pytest.mark.parametrize("bits,group", LAYOUTS)
def test_threads_split_columns_without_changing_any_sum(bits, group):
    _level(_native.select_isa())
    qw = qgemv.quantize_weight(_weights(200, 160), bits, group)
    x = torch.randn(6, 160)
    assert torch.equal(qgemv.qgemm(x, qw, threads=1), qgemv.qgemm(x, qw, threads=3))


@pytest.mark.parametrize("bits,group", LAYOUTS)
def test_quantization_error_within_half_a_step_of_float32(bits, group):
    w = _weights(48, 100, seed=3)
    qw = qgemv.quantize_weight(w, bits, group)
    assert qw.q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    deq = qgemv.dequantize_weight(qw)
    assert deq.shape == w.shape
    # the scale of each weight, broadcast back over its group, cut to K
    step = qw.s.repeat_interleave(qw.group, dim=-1)[:, : w.shape[1]]
    assert bool(((deq - w).abs() <= step / 2 * (1 + 1e-6) + 1e-12).all())
    qmax = 127 if bits == 8 else 7
    assert torch.allclose(step.amax(1)[1:], w.abs().amax(1)[1:] / qmax) or group != 0
    x = torch.randn(4, 100)
    y = qgemv.qgemm(x, qw)
    exact = x @ w.t()
    bound = x.abs() @ (step / 2).t()  # sum_k |x_k| * s_k / 2
    assert bool(((y - exact).abs() <= bound * 1.001 + 1e-4).all())


def test_int4_error_is_larger_than_int8_and_groups_help():
    w, x = _weights(64, 512, seed=5), torch.randn(8, 512)
    exact = x @ w.t()

    def err(bits: int, group: int) -> float:
        y = qgemv.qgemm(x, qgemv.quantize_weight(w, bits, group))
        return float((y - exact).norm() / exact.norm())

    # measured on these outlier-heavy weights: 0.009, 0.015, 0.15, 0.18, 0.28
    assert err(8, 32) < err(8, 0) < 0.02
    assert err(8, 0) < err(4, 32) < err(4, 64) < err(4, 0) < 0.35


def test_bytes_read_shrink_with_bits():
    w = _weights(256, 512)
    q8, q4 = qgemv.quantize_weight(w, 8, 0), qgemv.quantize_weight(w, 4, 64)
    assert q8.nbytes() == 256 * 512 + 256 * 4
    assert q4.nbytes() == 256 * 256 + 256 * 8 * 4
    assert q4[0].q.shape == (256,) or q4.q.dim() == 2  # 2-D: indexing gives a row


def test_stacked_experts_index_to_one_weight():
    w = torch.randn(3, 24, 40)
    qw = qgemv.quantize_weight(w, 4, 32)
    assert qw.q.shape == (3, 24, 32) and qw.s.shape == (3, 24, 2)
    x = torch.randn(2, 40)
    for e in range(3):
        one = qgemv.quantize_weight(w[e], 4, 32)
        assert torch.equal(qw[e].q, one.q) and torch.equal(qw[e].s, one.s)
        assert torch.allclose(qgemv.qgemm(x, qw[e]), qgemv.qgemm_reference(x, one), atol=1e-5)


def test_bad_inputs_name_the_problem():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="bits"):
        qgemv.quantize_weight(w, 3)
    with pytest.raises(ValueError, match="multiple of 32"):
        qgemv.quantize_weight(w, 4, 48)
    with pytest.raises(ValueError, match="float"):
        qgemv.quantize_weight(torch.ones(8, 64, dtype=torch.int32))
    qw = qgemv.quantize_weight(w, 8, 0)
    with pytest.raises(ValueError, match=r"x must be \[R, 64\]"):
        qgemv.qgemm(torch.randn(2, 63), qw)
    with pytest.raises(ValueError, match="one weight at a time"):
        qgemv.qgemm(torch.randn(2, 64), qgemv.quantize_weight(torch.randn(2, 8, 64)))


def test_without_the_native_build_qgemm_warns_once_and_uses_torch(monkeypatch):
    monkeypatch.setenv("MOEBIT_NATIVE", "0")
    monkeypatch.setattr(_qgemv_c, "_by_isa", {})
    monkeypatch.setattr(qgemv, "_warned", False)
    qw = qgemv.quantize_weight(torch.randn(16, 40), 4, 32)
    x = torch.randn(3, 40)
    with pytest.warns(RuntimeWarning, match="GEMV unavailable"):
        y = qgemv.qgemm(x, qw)
    assert torch.equal(y, qgemv.qgemm_reference(x, qw))
    assert not qgemv.native_available()


def test_moebit_isa_portable_forces_the_portable_build(monkeypatch):
    _level("portable")
    monkeypatch.setenv("MOEBIT_ISA", "portable")
    monkeypatch.setattr(_qgemv_c, "_by_isa", {})
    lib = _qgemv_c.load()  # the default level, as every caller loads it
    assert lib.moebit_isa == "portable" and lib.qg_isa() == 0
    qw = qgemv.quantize_weight(torch.randn(24, 96), 4, 32)
    x = torch.randn(5, 96)
    assert torch.allclose(qgemv.qgemm(x, qw), qgemv.qgemm_reference(x, qw), atol=1e-5)
