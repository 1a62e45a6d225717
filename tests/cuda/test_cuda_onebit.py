"""The 1-bit allreduce on CUDA (NCCL, or gloo moving CUDA tensors) equals the CPU gloo run."""

from __future__ import annotations

import pytest
import torch
from cuda_ranks import MODES, mismatch_fraction, rank_device, run_mode

from moebit.comm.compressed import OnebitAllreduce

pytestmark = pytest.mark.cuda

N = 300_001  # not a multiple of 8 * world: the padded tail is exercised


def _onebit_body(rank: int, world: int, mode: str, calls: int) -> list[torch.Tensor]:
    """Several calls on one name (error feedback carries over), then a bf16 buffer."""
    dev = rank_device(mode, rank)
    ar = OnebitAllreduce(segment_elements=1 << 16)  # 5 segments: the pipeline runs
    outs = []
    for c in range(calls):
        x = torch.randn(N, generator=torch.Generator().manual_seed(100 * c + rank))
        outs.append(ar.allreduce(x.to(dev), "grads").cpu())
    xb = torch.randn(N, generator=torch.Generator().manual_seed(7 + rank)).to(dev, torch.bfloat16)
    outs.append(ar.allreduce(xb, "bf16").float().cpu())
    errors = ar.state_dict()["buffers"]["grads"]["worker_error"]
    return [*outs, errors.cpu()]


@pytest.fixture(scope="module")
def cpu_result() -> list[list[torch.Tensor]]:
    return run_mode(_onebit_body, "cpu", args=(3,))


@pytest.mark.parametrize("mode", MODES)
def test_onebit_allreduce_on_cuda_equals_gloo_cpu(mode: str, cpu_result):
    got = run_mode(_onebit_body, mode, args=(3,))
    for rank in range(2):
        assert torch.equal(got[rank][0], got[1 - rank][0])  # every rank decodes the same
        for i, (g, want) in enumerate(zip(got[rank], cpu_result[rank], strict=True)):
            # Scales are sums in another order: equal to float rounding. A sign may flip
            # only where a value is within rounding of zero, so allow a few in a million.
            assert mismatch_fraction(g, want, rtol=1e-4, atol=1e-6) < 5e-6, (mode, rank, i)
