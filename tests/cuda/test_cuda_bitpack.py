"""The packer's CUDA path (plain torch ops) against the CPU path (native kernels if built)."""

from __future__ import annotations

import math

import pytest
import torch

from moebit.comm import bitpack

pytestmark = pytest.mark.cuda

SIZES = [1, 7, 8, 9, 4096, 1_000_003]


def _signal(n: int, seed: int = 0) -> torch.Tensor:
    """Random values with the edge cases of the sign convention at the front."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    edge = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-38, -1e-38])
    m = min(n, len(edge))
    x[:m] = edge[:m]
    return x


def _assert_same_signs(got: torch.Tensor, want: torch.Tensor, values: torch.Tensor) -> None:
    """Packed signs equal, except where the value is within rounding of zero: the two
    paths may sum in another order, and there a last-bit difference flips the sign."""
    n = values.numel()
    differ = bitpack.unpack_scaled(got.cpu(), n) != bitpack.unpack_scaled(want, n)
    assert bool((values[differ].abs() < 1e-5).all()), values[differ][:8]


@pytest.mark.parametrize("n", SIZES)
def test_pack_and_unpack_equal_cpu(n: int):
    x = _signal(n)
    packed = bitpack.pack_signs(x)
    assert torch.equal(bitpack.pack_signs(x.cuda()).cpu(), packed)
    assert torch.equal(bitpack.unpack_scaled(packed.cuda(), n, 0.75).cpu(),
                       bitpack.unpack_scaled(packed, n, 0.75))
    assert torch.equal(bitpack.unpack_signs(packed.cuda(), n, torch.bfloat16).cpu(),
                       bitpack.unpack_signs(packed, n, torch.bfloat16))


@pytest.mark.parametrize("n", SIZES)
def test_worker_step_equals_cpu(n: int):
    x, y0 = torch.randn(n), torch.randn(n)
    s = 0.37
    y_cpu, out_cpu = y0.clone(), torch.zeros((n + 7) // 8, dtype=torch.uint8)
    y_gpu, out_gpu = y0.cuda(), out_cpu.cuda()
    sq_cpu = bitpack.feedback_step_(x, y_cpu, s, out_cpu)
    sq_gpu = bitpack.feedback_step_(x.cuda(), y_gpu, s, out_gpu)
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=1e-6, atol=1e-7)
    _assert_same_signs(out_gpu, out_cpu, y_cpu)
    assert sq_gpu == pytest.approx(sq_cpu, rel=1e-5)
    torch.testing.assert_close(bitpack.feedback_error(y_gpu, s).cpu(),
                               bitpack.feedback_error(y_cpu, s), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [9, 4096, 1_000_003])
def test_server_step_equals_cpu(n: int):
    g = torch.Generator().manual_seed(3)
    nb = (n + 7) // 8
    rows = torch.randint(0, 256, (4, nb + 4), dtype=torch.uint8, generator=g)  # + scale bytes
    scales = [0.5, 0.25, 1.5, 0.125]
    z0 = torch.randn(n, generator=g)
    z_cpu, out_cpu = z0.clone(), torch.zeros(nb, dtype=torch.uint8)
    z_gpu, out_gpu = z0.cuda(), out_cpu.cuda()
    t_cpu = bitpack.server_step_(rows, scales, n, z_cpu, 0.2, out_cpu)
    t_gpu = bitpack.server_step_(rows.cuda(), scales, n, z_gpu, 0.2, out_gpu)
    torch.testing.assert_close(z_gpu.cpu(), z_cpu, rtol=1e-6, atol=1e-6)
    _assert_same_signs(out_gpu, out_cpu, z_cpu)
    assert t_gpu == pytest.approx(t_cpu, rel=1e-5)
    torch.testing.assert_close(bitpack.signs_weighted_sum(rows.cuda(), scales, n).cpu(),
                               bitpack.signs_weighted_sum(rows, scales, n))


def test_which_cpu_path_was_compared(capsys: pytest.CaptureFixture[str]):
    with capsys.disabled():
        path = "native kernels" if bitpack.native_available() else "the torch/numpy path"
        print(f"\nbitpack: CUDA results were compared with the CPU's {path}")
