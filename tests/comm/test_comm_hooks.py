"""DDP communication hooks on real gloo ranks: 1-bit training, and the freezable hook."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from moebit.comm import stats
from moebit.comm.hooks import (
    FreezableAllreduceState,
    OnebitHookState,
    freezable_allreduce_hook,
    onebit_hook,
)
from moebit.testing import run_on_ranks


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression task; each rank holds its own shard."""
    gen = torch.Generator().manual_seed(7)
    w_true = torch.randn(16, 1, generator=gen)
    gen.manual_seed(100 + rank)
    x = torch.randn(256, 16, generator=gen)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(256, 1, generator=gen)
    return x, y


# Plain SGD: with heavy momentum at a large step (lr 0.05, momentum 0.9) the 1-bit run of
# this tiny one-bucket model stalls at a loss of 0.38 against 0.012 exact; at lr 0.2 without
# momentum both reach about 0.05.
LR, MOMENTUM = 0.2, 0.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _train(
    rank: int, hook: bool, steps: int = 150, lr: float = LR, momentum: float = MOMENTUM
) -> tuple[DDP, OnebitHookState | None, float]:
    ddp = DDP(_model())
    state = None
    if hook:
        state = OnebitHookState(start_iter=5)
        ddp.register_comm_hook(state, onebit_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    x, y = _data(rank)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    # loss on both ranks' data, the quantity data-parallel training minimises
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(ddp.module(a), b) for a, b in map(_data, (0, 1))]
    return ddp, state, float(sum(losses) / 2)


def _ddp_body(rank: int, world: int) -> dict:
    out: dict = {}
    with torch.no_grad():
        out["initial"] = float(
            sum(torch.nn.functional.mse_loss(_model()(a), b) for a, b in map(_data, (0, 1))) / 2
        )
    _, _, out["exact"] = _train(rank, hook=False)
    stats.reset()
    ddp, state, out["onebit"] = _train(rank, hook=True)
    snap = stats.snapshot().as_dict()
    out["onebit_calls"] = snap.get("onebit.phase1", {}).get("calls", 0)
    out["params"] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    out["iter"] = state.iter
    clone = pickle.loads(pickle.dumps(state))
    out["clone"] = (clone.iter, clone.start_iter, clone.process_group is None)
    names = sorted(state.compressor.names())
    saved = state.compressor.state_dict()["buffers"]
    restored = clone.compressor.state_dict()["buffers"]
    out["clone_buffers_equal"] = names == sorted(restored) and all(
        torch.equal(saved[k]["worker_error"], restored[k]["worker_error"]) for k in names
    )
    out["buckets"] = len(names)
    out.update(_freezable(rank))
    return out


def _freezable(rank: int) -> dict:
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(8, 1))
    state = FreezableAllreduceState()
    ddp.register_comm_hook(state, freezable_allreduce_hook)
    x = torch.full((4, 8), float(rank + 1))

    def grad() -> torch.Tensor:
        ddp.zero_grad()
        ddp(x).sum().backward()
        return ddp.module.weight.grad.clone()

    before = grad()  # averaged over ranks: inputs 1 and 2 -> 1.5 * 4
    state.freeze()
    stats.reset()
    after = [grad() for _ in range(3)]  # local: 4 * (rank + 1)
    sent = stats.snapshot().bytes_sent
    restored = pickle.loads(pickle.dumps(state))
    return {"before": before, "after": after, "frozen_sent": sent,
            "frozen_pickled": restored.frozen and restored.process_group is None}


@pytest.fixture(scope="module")
def ddp_results() -> list[dict]:
    return run_on_ranks(_ddp_body, 2, timeout=180)


def test_onebit_hook_trains_as_well_as_exact_allreduce(ddp_results):
    r0, r1 = ddp_results
    assert r0["exact"] < 0.2 * r0["initial"]
    # close to the exact run (measured: 0.0550 against 0.0526)
    assert r0["onebit"] < 1.25 * r0["exact"]
    assert r0["onebit_calls"] == (150 - 5) * r0["buckets"]
    # every rank applied the same averaged gradients
    assert torch.equal(r0["params"], r1["params"])


def test_onebit_hook_state_pickles_without_the_process_group(ddp_results):
    for r in ddp_results:
        assert r["iter"] == 150
        assert r["clone"] == (150, 5, True)
        assert r["clone_buffers_equal"]


def test_freezable_hook_averages_then_goes_silent(ddp_results):
    for rank, r in enumerate(ddp_results):
        assert torch.allclose(r["before"], torch.full((1, 8), 4 * 1.5))
        for g in r["after"]:
            assert torch.allclose(g, torch.full((1, 8), 4.0 * (rank + 1)))
        assert r["frozen_sent"] == 0
        assert r["frozen_pickled"]


def test_hook_state_rejects_negative_start():
    with pytest.raises(ValueError, match="start_iter"):
        OnebitHookState(start_iter=-1)


def test_unpickled_state_in_a_single_process():
    state = OnebitHookState(start_iter=3)
    state.iter = 7
    clone = pickle.loads(pickle.dumps(state))
    assert (clone.iter, clone.start_iter) == (7, 3)
    assert not dist.is_initialized() and clone.compressor.world == 1
