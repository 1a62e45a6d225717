"""Sign packing: the bit convention, edge values, and native == torch/numpy paths."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from moebit.comm import _bitpack_c, bitpack

LENGTHS = [1, 7, 8, 9, 15, 64, 1001, 4099]


def expected_signs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.float() >= 0, 1.0, -1.0)


@pytest.fixture(params=["native", "portable"])
def path(request, monkeypatch):
    """Run a test on the compiled kernels and again on the torch/numpy fallback."""
    if request.param == "native":
        if not bitpack.native_available():
            pytest.skip("no C compiler: native kernels unavailable")
    else:
        monkeypatch.setattr(_bitpack_c, "load", lambda: None)
    return request.param


def test_native_kernels_build_from_scratch_where_gcc_exists(tmp_path):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    assert bitpack.native_available()
    # a clean machine: empty cache, the kernels compile at first use
    code = "from moebit.comm import bitpack; assert bitpack.native_available()"
    env = {**os.environ, "MOEBIT_NATIVE_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert len(list(tmp_path.glob("libmoebit_bitpack_*.so"))) == 1


def test_disabled_native_path_reports_itself(monkeypatch):
    monkeypatch.setenv("MOEBIT_NATIVE", "0")
    monkeypatch.setattr(_bitpack_c, "_tried", False)
    monkeypatch.setattr(_bitpack_c, "_lib", None)
    assert _bitpack_c.load() is None


@pytest.mark.parametrize("n", LENGTHS)
def test_round_trip_any_length(path, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    packed = bitpack.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
    assert torch.equal(bitpack.unpack_signs(packed, n), expected_signs(x))


def test_bit_order_and_padding(path):
    # element 8j+k -> bit k of byte j; unused high bits of the last byte are 0
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1, -2, 3])
    assert bitpack.pack_signs(x).tolist() == [0b10000001, 0b00000010]


def test_zero_negative_zero_nan_inf(path):
    x = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1e-30, 1e-30])
    signs = bitpack.unpack_signs(bitpack.pack_signs(x), x.numel())
    # IEEE comparison: both zeros are >= 0, NaN is not
    assert signs.tolist() == [1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0]
    assert torch.equal(bitpack.unpack_signs(bitpack.pack_signs(torch.zeros(13)), 13), torch.ones(13))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_float_dtypes(path, dtype):
    x = torch.randn(1001).to(dtype)
    signs = bitpack.unpack_signs(bitpack.pack_signs(x), 1001, dtype=dtype)
    assert signs.dtype == dtype
    assert torch.equal(signs.float(), expected_signs(x))


def test_matches_numpy_packbits():
    x = torch.randn(4099)
    ref = np.packbits(x.numpy() >= 0, bitorder="little")
    assert np.array_equal(bitpack.pack_signs(x).numpy(), ref)


def test_torch_op_path_matches_native_for_the_gpu_code():
    # The CUDA path is these torch ops; run them on CPU tensors against the kernels.
    x = torch.randn(1001)
    packed = bitpack._pack_torch(x)
    assert torch.equal(packed, bitpack.pack_signs(x))
    assert torch.equal(bitpack._signs_torch(packed, 1001), bitpack.unpack_signs(packed, 1001))


def test_integer_input_is_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        bitpack.pack_signs(torch.arange(10))


@pytest.mark.parametrize("n", [1, 13, 1000])
def test_unpack_scaled_and_weighted_sum(path, n):
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=gen) for _ in range(3)]
    scales = [0.5, 2.0, 0.25]
    packed = [bitpack.pack_signs(x) for x in xs]
    assert torch.allclose(bitpack.unpack_scaled(packed[0], n, 0.5), 0.5 * expected_signs(xs[0]))
    rows = torch.stack([torch.cat([p, torch.tensor([7, 7, 7], dtype=torch.uint8)]) for p in packed])
    want = sum(s * expected_signs(x) for s, x in zip(scales, xs, strict=True))
    assert torch.allclose(bitpack.signs_weighted_sum(rows, scales, n), want)


def _feedback_reference(x, y, s):
    err = torch.where(y >= 0, y - s, y + s)
    v = x + err
    return v, float((v.double() ** 2).sum())


@pytest.mark.parametrize("n", [5, 8, 1001])
def test_feedback_step_matches_reference(path, n):
    gen = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    want, want_sq = _feedback_reference(x, y.clone(), 0.7)
    out = torch.zeros((n + 7) // 8 + 4, dtype=torch.uint8)
    got_sq = bitpack.feedback_step_(x, y, 0.7, out)
    assert torch.allclose(y, want, atol=1e-6)
    assert got_sq == pytest.approx(want_sq, rel=1e-5)
    assert torch.equal(out[: (n + 7) // 8], bitpack.pack_signs(want))
    assert torch.allclose(bitpack.feedback_error(y, 0.3), torch.where(y >= 0, y - 0.3, y + 0.3))


@pytest.mark.parametrize("m", [0, 3, 8, 1001])
def test_server_step_matches_reference(path, m):
    gen = torch.Generator().manual_seed(m + 1)
    xs = [torch.randn(max(m, 1), generator=gen)[:m] for _ in range(4)]
    scales = [0.1, 0.2, 0.3, 0.4]
    nb = (m + 7) // 8
    rows = torch.zeros(4, nb + 4, dtype=torch.uint8)
    for r, x in enumerate(xs):
        rows[r, :nb] = bitpack.pack_signs(x)
    z = torch.randn(m, generator=gen)
    a = sum(s * expected_signs(x) for s, x in zip(scales, xs, strict=True))
    a = a if m else torch.zeros(0)
    want, want_sq = _feedback_reference(a, z.clone(), 0.5)
    out = torch.zeros(nb + 4, dtype=torch.uint8)
    got_sq = bitpack.server_step_(rows, scales, m, z, 0.5, out)
    assert torch.allclose(z, want, atol=1e-5)
    assert got_sq == pytest.approx(want_sq, rel=1e-5, abs=1e-9)
    assert torch.equal(out[:nb], bitpack.pack_signs(want))


def test_unpack_into_a_buffer_and_large_fresh_tensors(path):
    n = (1 << 21) + 3  # large enough for the huge-page allocation path
    x = torch.randn(n)
    packed = bitpack.pack_signs(x)
    buf = torch.full((n,), 7.0)
    assert bitpack.unpack_signs(packed, n, out=buf) is buf
    assert torch.equal(buf, expected_signs(x))
    assert torch.equal(bitpack.unpack_signs(packed, n), expected_signs(x))
    half = bitpack.unpack_signs(packed, n, dtype=torch.float16, out=torch.empty(n).half())
    assert torch.equal(half.float(), expected_signs(x))
