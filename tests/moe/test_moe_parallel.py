"""Expert parallelism on real gloo ranks against the same experts in one process.

Each rank routes its own tokens (so capacity is per rank, as in training); the one-process
reference runs the same layer (same seed, all E experts) on every rank's tokens in turn.
After `allreduce_grads_(split_params_for_ep(moe))` every rank's gradients must equal the
reference gradients of the mean loss over ranks, expert slices included.
"""

from __future__ import annotations

import torch

from moebit.comm import stats
from moebit.moe import (
    MoE,
    MoEConfig,
    all_to_all,
    allreduce_grads_,
    expert_parallel_groups,
    split_params_for_ep,
)
from moebit.testing import run_on_ranks

TIMEOUT = 120
D = 16


def _inputs(world: int, s: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    xs = [torch.randn(s, D, generator=g) for _ in range(world)]
    projs = [torch.randn(s, D, generator=g) for _ in range(world)]
    return xs, projs


def _check_against_one_process(rank: int, world: int, ep_size: int, cfg: MoEConfig) -> int:
    groups = expert_parallel_groups(ep_size)
    torch.manual_seed(0)
    moe = MoE(D, cfg, groups)
    torch.manual_seed(0)
    ref = MoE(D, cfg.replace(ep_size=1))
    xs, projs = _inputs(world, s=48)

    before = stats.snapshot()
    x = xs[rank].clone().requires_grad_(True)
    out = moe(x)
    ((out.hidden * projs[rank]).sum() + out.aux_loss).backward()
    moved = stats.snapshot().minus(before).ops["moe.all_to_all"].bytes_sent
    allreduce_grads_(split_params_for_ep(moe))

    ref_total = 0.0
    for r in range(world):
        xr = xs[r].clone().requires_grad_(True)
        o = ref(xr)
        ref_total = ref_total + (o.hidden * projs[r]).sum() + o.aux_loss
        if r == rank:
            assert torch.allclose(out.hidden, o.hidden, atol=1e-5), "outputs differ"
            assert torch.equal(out.stats.tokens_per_expert, o.stats.tokens_per_expert)
            ref_x, ref_out = xr, o
    (ref_total / world).backward()
    assert torch.allclose(x.grad, ref_x.grad * world, atol=1e-5), "input gradients differ"
    assert torch.allclose(out.aux_loss, ref_out.aux_loss)

    n_local = cfg.num_experts // ep_size
    lo = groups.ep_ranks.index(rank) * n_local
    assert moe.experts.first_expert == lo
    assert torch.allclose(moe.gate.router.weight.grad, ref.gate.router.weight.grad, atol=1e-5)
    for name in ("w1", "b1", "w2", "b2"):
        mine = getattr(moe.experts, name)
        full = getattr(ref.experts, name)
        assert torch.equal(mine.data, full.data[lo : lo + n_local]), f"{name} init differs"
        assert torch.allclose(mine.grad, full.grad[lo : lo + n_local], atol=1e-5), name
    return moved


def _check_autocast(rank: int, world: int, groups) -> None:
    """Under bf16 autocast the tokens travel in bf16 and the result matches one process."""
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, ep_size=2, d_ffn=20)
    torch.manual_seed(0)
    moe = MoE(D, cfg, groups)
    torch.manual_seed(0)
    ref = MoE(D, cfg.replace(ep_size=1))
    xs, _ = _inputs(world, s=32)
    before = stats.snapshot()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = moe(xs[rank])
        want = ref(xs[rank]).hidden
    op = stats.snapshot().minus(before).ops["moe.all_to_all"]
    assert o.hidden.dtype == torch.bfloat16
    assert torch.allclose(o.hidden.float(), want.float(), atol=1e-2, rtol=1e-2)
    me = groups.ep_ranks.index(rank)
    other = 1 - me
    peer = ref(xs[groups.ep_ranks[other]])  # the other rank's routing (same router weights)
    mine_out = int(o.stats.kept_per_expert[2 * other : 2 * other + 2].sum())
    theirs_in = int(peer.stats.kept_per_expert[2 * me : 2 * me + 2].sum())
    assert mine_out > 0 and theirs_in > 0
    # [E] int64 counts (half off-rank), my tokens out, the other rank's results back: bf16
    assert op.bytes_sent == 2 * 8 + (mine_out + theirs_in) * D * 2


def _ep_body(rank: int, world: int, ep_size: int) -> dict[str, object]:
    moved = _check_against_one_process(
        rank, world, ep_size,
        MoEConfig(num_experts=4, num_experts_per_tok=2, ep_size=ep_size, capacity_factor=0.75,
                  min_capacity=1, d_ffn=20, router_z_loss_coef=0.01),
    )
    _check_against_one_process(
        rank, world, ep_size,
        MoEConfig(num_experts=8, num_experts_per_tok=1, ep_size=ep_size, drop_tokens=False,
                  d_ffn=20),
    )
    groups = expert_parallel_groups(ep_size)
    _check_autocast(rank, world, groups)
    try:
        expert_parallel_groups(3)
        bad = "no error"
    except ValueError as e:
        bad = str(e)
    return {"moved": moved, "ep": groups.ep_ranks, "edp": groups.expert_dp_ranks, "bad": bad}


def test_ep2_on_two_ranks_matches_one_process() -> None:
    res = run_on_ranks(_ep_body, world=2, args=(2,), timeout=TIMEOUT)
    assert [r["ep"] for r in res] == [(0, 1), (0, 1)]
    assert [r["edp"] for r in res] == [(0,), (1,)]
    assert all(r["moved"] > 0 for r in res)
    assert "does not divide" in res[0]["bad"]


def test_ep2_dp2_on_four_ranks_matches_one_process() -> None:
    res = run_on_ranks(_ep_body, world=4, args=(2,), timeout=TIMEOUT)
    assert [r["ep"] for r in res] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["edp"] for r in res] == [(0, 2), (1, 3), (0, 2), (1, 3)]


def _uneven_body(rank: int, world: int) -> dict[str, object]:
    send = [[3, 0], [2, 4]][rank]  # rank 0 sends nothing to rank 1
    recv = [[3, 2], [0, 4]][rank]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.arange(sum(send) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank)
        x = x.to(dtype).requires_grad_(True)
        stats.reset()
        y = all_to_all(x, send, recv, None)
        (y.float() * torch.arange(1, y.shape[0] + 1).unsqueeze(1)).sum().backward()
        s = stats.snapshot().ops["moe.all_to_all"]
        out[str(dtype)] = (y.detach().float(), x.grad.float(), s.bytes_sent, s.bytes_recv)
    return out


def test_gloo_all_to_all_uneven_and_empty_splits() -> None:
    r0, r1 = run_on_ranks(_uneven_body, world=2, timeout=TIMEOUT)
    for key in ("torch.float32", "torch.bfloat16"):
        y0, g0, sent0, recv0 = r0[key]
        y1, g1, sent1, recv1 = r1[key]
        x0 = torch.arange(6.0).view(3, 2)
        x1 = torch.arange(12.0).view(6, 2) + 100
        assert torch.equal(y0, torch.cat([x0, x1[:2]]))
        assert torch.equal(y1, x1[2:])
        # backward sends each row's gradient (its 1-based row index on the receiver) home
        assert torch.equal(g0[:, 0], torch.tensor([1.0, 2.0, 3.0]))
        assert torch.equal(g1[:, 0], torch.tensor([4.0, 5.0, 1.0, 2.0, 3.0, 4.0]))
        row = 2 * (4 if key == "torch.float32" else 2)
        # forward + backward: rank 0 sends 0 rows off-rank, then returns 2 gradient rows
        assert (sent0, recv0) == (2 * row, 2 * row)
        assert (sent1, recv1) == (2 * row, 2 * row)
