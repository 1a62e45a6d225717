"""Resuming a DiLoCo run in the middle of an interval continues bit for bit.

A straight run saves at step 6 (between syncs; for Streaming DiLoCo with a fragment's
exchange in flight) and finishes at 10. A copy of its folder without the step-10
checkpoint resumes from step 6: its step-10 checkpoint must equal the straight one, the
weights and every rank's outer state (theta_sync, momentum, error buffers).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_outer_loop import cfg_for, records, shard

from moebit.testing import run_on_ranks
from moebit.training.config import build

DENSE = {"outer_group": "world"}
EP2 = {"num_experts": 4, "num_experts_per_tok": 2, "ep_size": 2, "outer_group": "node"}
CASES = {
    # name: (ranks, settings); ep 2 runs two nodes of 2 ranks (LOCAL_WORLD_SIZE=2)
    "diloco-1bit-dense": (2, {"outer": "diloco", "outer_compress": "1bit", **DENSE}),
    "streaming-int8-dense": (2, {"outer": "streaming_diloco", "outer_fragments": 2,
                                 "outer_delay": 1, "outer_alpha": 0.5,
                                 "outer_compress": "int8", **DENSE}),
    "diloco-1bit-ep2": (4, {"outer": "diloco", "outer_compress": "1bit", **EP2}),
    "streaming-bf16-ep2": (4, {"outer": "streaming_diloco", "outer_delay": 1,
                               "outer_compress": "bf16", **EP2}),
}


def _train(rank: int, world: int, cfg_dict: dict, run_dir: str) -> dict:
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    return train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in _tensors(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


@pytest.mark.timeout(700)  # two runs on up to 4 ranks
@pytest.mark.parametrize("name", list(CASES))
def test_resume_mid_interval_is_bit_exact(small_corpus: Path, tmp_path: Path, name: str):
    world, settings = CASES[name]
    env = {"LOCAL_WORLD_SIZE": "2"}
    cfg = cfg_for(small_corpus, steps=10, save_every=6, outer_every=4, dropout=0.1,
                  grad_clip=1.0, log_every=5, **settings)
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_on_ranks(_train, world, args=(cfg, str(straight)), timeout=300, env=env)
    shutil.copytree(straight, split)
    shutil.rmtree(split / "checkpoints" / "step-00000010")
    mid = [shard(split, 6, r)["model"] for r in range(world)]
    dense_keys = [k for k in mid[0] if ".experts." not in k]
    if world == 4:  # two nodes: the per-step averages stay inside a node (inner group)
        assert all(torch.equal(mid[0][k], mid[1][k]) for k in dense_keys)
        assert not all(torch.equal(mid[0][k], mid[2][k]) for k in dense_keys)
    else:  # every rank its own worker: apart between syncs
        assert not all(torch.equal(mid[0][k], mid[1][k]) for k in dense_keys)
    pending = shard(split, 6, 0)["outer"]["state"]["outer"]["pending"]
    assert (pending is not None) == (settings["outer"] == "streaming_diloco")
    run_on_ranks(_train, world, args=({**cfg, "resume": True}, str(split)), timeout=300,
                 env=env)
    for rank in range(world):
        a, b = shard(straight, 10, rank), shard(split, 10, rank)
        for k, v in a["model"].items():
            assert torch.equal(v, b["model"][k]), (rank, k)
        ta, tb = _tensors(a["outer"]["state"]), _tensors(b["outer"]["state"])
        assert len(ta) == len(tb) > 0
        assert all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True)), rank
        assert a["outer"]["state"]["outer"]["sync_count"] == b["outer"]["state"]["outer"]["sync_count"]
    # The run ends on one agreed model: every rank's dense weights are equal.
    dense = [k for k in shard(straight, 10, 0)["model"] if ".experts." not in k]
    ends = [shard(straight, 10, r)["model"] for r in range(world)]
    for k in dense:
        assert all(torch.equal(ends[0][k], e[k]) for e in ends[1:]), k
    kinds = [r["kind"] for r in records(split)]
    assert kinds.count("resume") == 1 and kinds[-1] == "end"
