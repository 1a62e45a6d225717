"""The native step's float32 products (``_f32_c``): register tiles of rows and columns."""

from __future__ import annotations

import pytest
import torch

from moebit.comm._native import supported_isas
from moebit.inference import _fused_c

# rows x outputs x K: every tile shape (1-4 rows, 1-4 columns) and K with and without a
# masked tail (K not a multiple of 8 or 16)
SHAPES = ((1, 5, 7), (2, 3, 16), (3, 9, 33), (4, 8, 64), (5, 17, 128), (8, 40, 100),
          (7, 6, 1), (6, 11, 24))


@pytest.mark.parametrize("isa", supported_isas())
def test_f32_products_equal_a_double_reference_and_each_row_alone(isa: str) -> None:
    """y = x @ w^T to float rounding, and each row's outputs bitwise the same whether the
    row is multiplied alone or in a batch (a prompt chunk, a serving batch and a lone
    decode row must agree exactly)."""
    lib = _fused_c.load(isa)
    assert lib is not None
    torch.manual_seed(0)
    for r, n, k in SHAPES:
        w, x = torch.randn(n, k), torch.randn(r, k)
        y = torch.full((r, n), float("nan"))
        lib.fd_f32(w.data_ptr(), x.data_ptr(), r, n, k, y.data_ptr())
        want = x.double() @ w.double().t()
        torch.testing.assert_close(y.double(), want, atol=1e-5 * k ** 0.5, rtol=1e-5)
        for i in range(r):
            one = torch.empty(1, n)
            lib.fd_f32(w.data_ptr(), x[i:i + 1].contiguous().data_ptr(), 1, n, k,
                       one.data_ptr())
            assert torch.equal(one[0], y[i]), (isa, r, n, k, i)


@pytest.mark.parametrize("isa", supported_isas())
def test_vector_exp_is_within_2_ulp_of_expf(isa: str) -> None:
    """The SiLU and softmax exp: within 2 ulp of the correctly rounded e^x where e^x is a
    normal float and exact at 0; beyond, the vector exp gives about 1e-38 (never 0, inf or
    NaN), in a vector's last part too (libm's expf, in portable builds, gives 0)."""
    lib = _fused_c.load(isa)
    x = torch.cat([torch.linspace(-87.0, 88.0, 200_003), torch.tensor([0.0, -200.0, -88.0, 1e-8])])
    y = torch.empty_like(x)
    lib.fd_exp(x.data_ptr(), y.data_ptr(), x.numel())
    normal = x[:-3]
    want = torch.exp(normal.double())
    ulp = (want.float().nextafter(torch.tensor(float("inf"))) - want.float()).double()
    err = ((y[:-3].double() - want).abs() / ulp)
    assert err.max() <= 2.0, (isa, err.max().item(), normal[err.argmax()].item())
    assert y[-4] == 1.0 and torch.isfinite(y).all() and (y[-3:-1] < 1e-37).all()
    if isa != "portable":
        assert (y > 0).all()
