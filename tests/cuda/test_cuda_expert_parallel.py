"""Expert parallelism across 2 ranks on CUDA (NCCL, or gloo on CUDA tensors) equals gloo on CPU."""

from __future__ import annotations

import pytest
import torch
from cuda_ranks import MODES, rank_device, rel_error, run_mode

pytestmark = pytest.mark.cuda


def _ep_body(rank: int, world: int, mode: str, bf16: bool) -> dict[str, torch.Tensor]:
    """One MoE layer split over 2 ranks: forward, backward; this rank's outputs and grads."""
    from moebit.moe import MoE, MoEConfig, expert_parallel_groups

    dev = rank_device(mode, rank)
    groups = expert_parallel_groups(2)
    torch.manual_seed(0)  # the same router and global experts everywhere
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, capacity_factor=1.5, d_ffn=128,
                    ep_size=2)
    moe = MoE(64, cfg, groups).to(dev)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank routes its own tokens
    x = torch.randn(2, 80, 64, generator=gen).to(dev).requires_grad_(True)
    g = torch.randn(2, 80, 64, generator=gen).to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        out = moe(x)
    ((out.hidden.float() * g).sum() + 10 * out.aux_loss).backward()
    res = {"hidden": out.hidden, "x.grad": x.grad}
    res.update({f"{n}.grad": p.grad for n, p in moe.named_parameters()})
    return {k: v.detach().float().cpu() for k, v in res.items()}


@pytest.fixture(scope="module")
def cpu_runs() -> dict[bool, list[dict[str, torch.Tensor]]]:
    """The gloo CPU reference, once per dtype for all the CUDA cases."""
    return {bf16: run_mode(_ep_body, "cpu", args=(bf16,)) for bf16 in (False, True)}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_expert_parallel_on_cuda_equals_gloo_cpu(mode: str, bf16: bool, cpu_runs):
    want = cpu_runs[bf16]
    got = run_mode(_ep_body, mode, args=(bf16,))
    for rank in range(2):
        for name, w in want[rank].items():
            if bf16:  # the tokens travel in bf16 and the experts compute in it
                assert rel_error(got[rank][name], w) < 2e-2, (rank, name)
            else:
                torch.testing.assert_close(got[rank][name], w, rtol=1e-4, atol=1e-5,
                                           msg=f"rank {rank} {name}")
