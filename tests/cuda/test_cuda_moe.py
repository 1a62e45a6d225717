"""The MoE layer on CUDA equals the CPU layer: forward, backward, every expert kernel.

fp32 must agree to float rounding (TF32 stays off, torch's default for matmuls). bf16 runs
the training path (autocast: float32 router, bf16 experts) and is held to the standard
of the CPU's own bf16 run: no further from the fp32 result than CPU bf16 is, give or take.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cuda_ranks import rel_error

from moebit.moe import MoE, MoEConfig

pytestmark = pytest.mark.cuda

KERNELS = ("loop", "padded")


def _layer(kernel: str, residual: bool = False) -> MoE:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, capacity_factor=1.25, d_ffn=256,
                    router_z_loss_coef=1e-3)
    moe = MoE(128, cfg)
    moe.experts.kernel = kernel
    return moe


def _run(moe: MoE, device: str, bf16: bool) -> dict[str, torch.Tensor]:
    """Forward and backward on fixed data; everything returned on the CPU in float32."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 96, 128, generator=gen).to(device).requires_grad_(True)
    g = torch.randn(4, 96, 128, generator=gen).to(device)
    moe = moe.to(device)
    for p in moe.parameters():
        p.grad = None
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        out = moe(x)
    ((out.hidden.float() * g).sum() + 100 * out.aux_loss).backward()
    res = {"hidden": out.hidden, "x.grad": x.grad, "kept": out.stats.kept_per_expert,
           "aux": out.aux_loss}
    res.update({f"{n}.grad": p.grad for n, p in moe.named_parameters()})
    return {k: v.detach().float().cpu() for k, v in res.items()}


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp32_forward_backward_on_cuda_equals_cpu(kernel: str):
    moe = _layer(kernel)
    want = _run(copy.deepcopy(moe), "cpu", bf16=False)
    got = _run(moe, "cuda", bf16=False)
    assert torch.equal(got["kept"], want["kept"])  # same routing, so the same blocks
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_forward_backward_on_cuda_as_close_as_cpu_bf16(kernel: str):
    moe = _layer(kernel)
    exact = _run(copy.deepcopy(moe), "cpu", bf16=False)
    cpu16 = _run(copy.deepcopy(moe), "cpu", bf16=True)
    gpu16 = _run(moe, "cuda", bf16=True)
    assert torch.equal(gpu16["kept"], cpu16["kept"])  # the router computes in float32
    for name in exact:
        if name == "kept":
            continue
        e_gpu, e_cpu = rel_error(gpu16[name], exact[name]), rel_error(cpu16[name], exact[name])
        assert e_gpu < 2e-2, (name, e_gpu)  # bf16 keeps 8 bits: about 0.4% per rounding
        assert e_gpu <= 2 * e_cpu + 1e-3, (name, e_gpu, e_cpu)
