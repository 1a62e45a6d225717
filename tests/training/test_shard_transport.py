"""The transport of exact sharded collectives: both candidates give the backend's result,
the measured choice is the same on every rank, remembered by group rank 0, and followed
by ranks whose own file says otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moebit.moe import autotune
from moebit.testing import run_on_ranks
from moebit.training.shard_transport import TRANSPORT_AG, TRANSPORT_RS, Transport, problem_key

N = 4096


def _results(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world * N, generator=g)
    out = {}
    for name, fn in TRANSPORT_RS.items():
        got = torch.empty(N)
        fn(got, x.clone(), dist.group.WORLD)
        out[f"rs_{name}"] = got
    shard = torch.full((N,), float(rank))
    for name, fn in TRANSPORT_AG.items():
        got = torch.empty(world * N)
        fn(got, shard, dist.group.WORLD)
        out[f"ag_{name}"] = got
    everyone = [torch.randn(world * N, generator=torch.Generator().manual_seed(r))
                for r in range(world)]
    out["rs_want"] = torch.stack(everyone).sum(0).view(world, N)[rank]
    return out


def _choices(rank: int, world: int, cache: str) -> dict:
    os.environ["MOEBIT_AUTOTUNE"] = "1"
    os.environ["MOEBIT_AUTOTUNE_CACHE"] = cache if rank == 0 else f"{cache}.rank{rank}"
    autotune.reset()
    inp, out = torch.zeros(world * N), torch.empty(N)
    key = problem_key("rs", dist.group.WORLD, inp.numel(), inp.dtype)
    if rank == 1:  # a rank whose own file remembers the other choice
        autotune.remember(key, "native", {})
    first = Transport("rs", TRANSPORT_RS)(out, inp, dist.group.WORLD)
    again = Transport("rs", TRANSPORT_RS)(out, inp, dist.group.WORLD)  # a new unit: remembered
    if rank == 0:  # rank 0 now says a2a: everyone follows
        autotune.remember(key, "a2a", {})
    followed = Transport("rs", TRANSPORT_RS)(out, inp, dist.group.WORLD)
    return {"first": first, "again": again, "followed": followed, "key": key}


def test_both_transports_give_the_backends_results() -> None:
    for r, res in enumerate(run_on_ranks(_results, 3, timeout=120)):
        for name in TRANSPORT_RS:
            torch.testing.assert_close(res[f"rs_{name}"], res["rs_want"], rtol=1e-6, atol=1e-5)
        want = torch.arange(3.0).repeat_interleave(N)
        for name in TRANSPORT_AG:
            assert torch.equal(res[f"ag_{name}"], want), (r, name)


def test_the_measured_choice_is_agreed_remembered_by_rank_0_and_followed(tmp_path: Path
                                                                         ) -> None:
    cache = str(tmp_path / "autotune.json")
    res = run_on_ranks(_choices, 2, args=(cache,), timeout=120)
    assert res[0]["first"] in ("native", "a2a")
    assert {r["first"] for r in res} == {res[0]["first"]}
    assert {r["again"] for r in res} == {res[0]["first"]}
    assert {r["followed"] for r in res} == {"a2a"}
    entry = next(iter(json.loads(Path(cache).read_text()).values()))[res[0]["key"]]
    assert entry["choice"] == "a2a"


def test_an_unknown_transport_is_named() -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        Transport("rs", TRANSPORT_RS, "ring")
