"""The int8 wire format's two implementations: the native kernel and the torch path.

Both must give the same bytes and the same decoded rows, so that ranks with and without a C
compiler stay identical, and a row with NaN or inf must decode to NaN in both (a fault
must not turn into finite activations on the far side).
"""

from __future__ import annotations

import pytest
import torch

from moebit.comm import _rowquant_c
from moebit.comm import all_to_all as a2a

SHAPES = [(64, 256), (7, 13), (0, 16), (5, 600), (3, 1)]


def _native() -> None:
    if _rowquant_c.load() is None:
        pytest.skip("no native int8 kernel here (no gcc, or MOEBIT_NATIVE=0)")


def _rows(n: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 1000 + d)
    x = torch.randn(n, d, generator=g)
    if n:
        x = x * torch.logspace(-4, 4, n).unsqueeze(1)
        x[n // 2] = 0.0
    return x


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int8_equals_the_torch_path(shape: tuple[int, int], dtype: torch.dtype) -> None:
    _native()
    x = _rows(*shape).to(dtype)
    native = _rowquant_c.encode_int8(x)
    assert native is not None
    assert torch.equal(native, a2a._encode_scaled(x, "int8"))
    d = shape[1]
    for out_dtype in (torch.float32, torch.bfloat16):
        got = _rowquant_c.decode_int8(native, out_dtype, d)
        q, scale = native[:, :d].view(torch.int8), native[:, d:].contiguous().view(torch.float32)
        assert got is not None and got.dtype == out_dtype
        assert torch.equal(got, torch.mul(q, scale).to(out_dtype))


def test_encode_takes_the_torch_path_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    _native()
    x = _rows(32, 40)
    with_kernel = a2a.encode(x, "int8")
    monkeypatch.setattr(_rowquant_c, "_lib", None)
    assert _rowquant_c.encode_int8(x) is None
    assert torch.equal(a2a.encode(x, "int8"), with_kernel)
    assert torch.equal(a2a.decode(with_kernel, "int8", x.dtype, 40),
                       torch.mul(with_kernel[:, :40].view(torch.int8),
                                 with_kernel[:, 40:].contiguous().view(torch.float32)))


@pytest.mark.parametrize("native", [True, False])
def test_non_finite_rows_decode_to_nan(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if native:
        _native()
    else:
        monkeypatch.setattr(_rowquant_c, "_lib", None)
        monkeypatch.setattr(_rowquant_c, "_tried", True)
    x = _rows(4, 40)
    x[1, 3], x[2, 39] = float("nan"), float("inf")
    y = a2a.decode(a2a.encode(x, "int8"), "int8", x.dtype, 40)
    assert bool(y[1].isnan().all()) and bool(y[2].isnan().all())
    assert bool(y[[0, 3]].isfinite().all())
    assert bool(((y[[0, 3]] - x[[0, 3]]).abs() <= x[[0, 3]].abs().amax(1, True) / 254 * 1.00001).all())
