"""DiLoCo and Streaming DiLoCo over FSDP2: 4 gloo ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2).

fsdp shards inside each node and the outer step syncs the ranks holding the same shard
(rank j of node 0 with rank j of node 1) on their local shards. One rank pool runs every
training of the module: DiLoCo and Streaming DiLoCo unsharded and sharded (sharding must
not change the maths: the losses agree), a sharded 1-bit DiLoCo run and an int8 Streaming
run that save between syncs, and their resumes from there (bit-exact). A hook snapshots
each rank's local shards before every step, so the test sees the outer-group replicas
agree right after each sync and drift apart between syncs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_outer_loop import cfg_for

from moebit.optim.outer import local_tensor
from moebit.testing import run_on_ranks
from moebit.training.config import build

STEPS, H = 12, 4
DILOCO = {"outer": "diloco", "outer_every": H}
STREAMING = {"outer": "streaming_diloco", "outer_every": H, "outer_fragments": 2,
             "outer_delay": 1, "outer_alpha": 0.5, "outer_compress": "bf16"}
# experts: 2 ep ranks per node, each holding 2 of the 4 experts (efsdp = 1 inside a node)
EP2 = {**DILOCO, "num_experts": 4, "num_experts_per_tok": 2, "ep_size": 2}
MOE = {**EP2, "ep_size": 1}  # every rank holds all experts, fsdp shards them like dense ones
INT8 = {**DILOCO, "outer_compress": "int8"}
# name: (settings, sharded); the sharded ones have an unsharded twin of the same settings
RUNS = {"diloco": (DILOCO, False), "diloco_fsdp": (DILOCO, True),
        "streaming": (STREAMING, False), "streaming_fsdp": (STREAMING, True),
        "ep2": (EP2, False), "ep2_fsdp": (EP2, True), "moe": (MOE, False),
        "moe_fsdp": (MOE, True), "int8_fsdp": (INT8, True)}
# sharded runs saved at step 6 and resumed from there: DiLoCo between the syncs at 4 and 8
# (1-bit error buffers), Streaming with fragment 1's exchange (started at 6) in flight
RESUMED = {"onebit": {**DILOCO, "outer_compress": "1bit"},
           "stream8": {**STREAMING, "outer_compress": "int8"}}


def _snapshots(store: list[torch.Tensor]):  # noqa: ANN202 - a Hooks.before_step
    def before_step(loop, step: int) -> None:  # noqa: ANN001
        held = [local_tensor(p).detach().reshape(-1) for p in loop.model.parameters()]
        store.append(torch.cat(held).clone())
    return before_step


def _train(cfg: dict, run: Path, info) -> tuple[dict, list[torch.Tensor]]:  # noqa: ANN001
    from moebit.training.hooks import Hooks
    from moebit.training.loop import train

    seen: list[torch.Tensor] = []
    end = train(build({**cfg, "run_dir": str(run)}), run, info,
                Hooks(before_step=_snapshots(seen)))
    return end, seen


def _pool(rank: int, world: int, corpus: str, root: str) -> dict:
    from moebit.comm.collectives import init_from_env

    info = init_from_env("cpu")
    base = Path(root)
    common = cfg_for(Path(corpus), steps=STEPS, log_every=1, grad_clip=1.0)
    out: dict = {}
    for name, (settings, sharded) in RUNS.items():
        cfg = {**common, **settings, **({"shard": "fsdp"} if sharded else {})}
        out[name] = _train(cfg, base / name, info)
    saving = {**common, "shard": "fsdp", "save_every": 6, "keep_checkpoints": 3, "dropout": 0.1}
    for name, settings in RESUMED.items():
        cfg = {**saving, **settings}
        out[name] = _train(cfg, base / name, info)
        if rank == 0:  # the same run, resumed from step 6
            shutil.copytree(base / name, base / f"{name}_resumed")
            shutil.rmtree(base / f"{name}_resumed" / "checkpoints" / f"step-{STEPS:08d}")
        dist.barrier()
        out[f"{name}_resumed"] = _train({**cfg, "resume": True}, base / f"{name}_resumed", info)
    return out


@pytest.fixture(scope="module")
def pool(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("outer_shard")
    ranks = run_on_ranks(_pool, 4, args=(str(small_corpus), str(root)), timeout=600,
                         env={"LOCAL_WORLD_SIZE": "2"})
    return {"root": root, "ranks": ranks}


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run) if r["kind"] == "train"}


@pytest.mark.parametrize("name", ["diloco", "streaming", "ep2", "moe"])
def test_sharding_inside_the_nodes_does_not_change_the_losses(pool, name: str) -> None:
    plain, sharded = _losses(pool["root"] / name), _losses(pool["root"] / f"{name}_fsdp")
    assert sorted(plain) == list(range(1, STEPS + 1)) == sorted(sharded)
    for step in plain:
        assert abs(plain[step] - sharded[step]) <= 1e-5, (step, plain[step], sharded[step])
    assert plain[STEPS] < plain[1]  # it trained
    syncs = [r for r in _records(pool["root"] / f"{name}_fsdp") if r["kind"] == "outer"]
    want = [r for r in _records(pool["root"] / name) if r["kind"] == "outer"]
    assert [r["step"] for r in syncs] == [r["step"] for r in want] and syncs
    for a, b in zip(syncs, want, strict=True):  # rank 0 sent its shard's half of the norm
        assert 0 < a["outer_mean_pseudo_grad_norm"] < b["outer_mean_pseudo_grad_norm"]


def test_int8_pseudo_gradients_of_shards_stay_near_the_exact_run(pool) -> None:
    """int8 rounds per block of 256 elements of the flat pseudo-gradient, and a shard's
    blocks are not the replica's: equal up to the first applied sync, then close."""
    exact, int8 = _losses(pool["root"] / "diloco"), _losses(pool["root"] / "int8_fsdp")
    for step in exact:
        tol = 1e-5 if step <= H else 2e-2
        assert abs(exact[step] - int8[step]) <= tol, (step, exact[step], int8[step])
    assert any(abs(exact[s] - int8[s]) > 1e-6 for s in exact)  # int8 did round


@pytest.mark.parametrize("name", ["diloco_fsdp", "streaming_fsdp", "ep2_fsdp", "moe_fsdp",
                                  "int8_fsdp", "onebit"])
def test_outer_group_replicas_hold_identical_shards_after_each_sync(pool, name: str) -> None:
    """Before 0-based step t, t steps are done: DiLoCo synced at t = 4 and 8; Streaming's
    fragment 0 (offset 0) exchanged at 4 and 8, and was applied one step later (delay 1)
    mixed with the local values, so only DiLoCo's replicas agree exactly there."""
    ranks = pool["ranks"]
    for j in (0, 1):  # rank j of node 0 and rank j of node 1 hold the same shard
        a, b = ranks[j][name][1], ranks[j + 2][name][1]
        assert len(a) == len(b) == STEPS
        assert torch.equal(a[0], b[0])  # every replica starts from rank 0's weights
        for t in range(1, STEPS):
            if name != "streaming_fsdp" and t % H == 0:
                assert torch.equal(a[t], b[t]), (name, j, t)
            elif t % H != 0:
                assert not torch.equal(a[t], b[t]), (name, j, t)  # the nodes drift apart
        if name not in ("ep2_fsdp", "moe_fsdp"):  # each rank holds half of the node's model
            full = ranks[j]["diloco"][1][0].numel()
            assert abs(a[0].numel() / full - 0.5) < 0.02, (a[0].numel(), full)
    ends = [r[name][0] for r in ranks]
    assert all(e["outer_syncs"] == ends[0]["outer_syncs"] > 0 for e in ends)


def test_outer_state_per_rank_is_half_of_the_unsharded_one(pool) -> None:
    start = {n: next(r for r in _records(pool["root"] / n) if r["kind"] == "start")
             for n in ("diloco", "diloco_fsdp")}
    ratio = start["diloco_fsdp"]["outer_state_bytes"] / start["diloco"]["outer_state_bytes"]
    assert abs(ratio - 0.5) < 0.02, ratio
    end_rep, end_fsdp = pool["ranks"][0]["diloco"][0], pool["ranks"][0]["diloco_fsdp"][0]
    assert end_fsdp["state_bytes_per_rank"] < 0.6 * end_rep["state_bytes_per_rank"]
    # Each rank sends half the model per sync either way: its shards, or (unsharded) its
    # slice of the node's exchange, which the node then all-gathers over its own link
    sent_rep = end_rep["bytes_sent_by_kind"]["outer"]
    sent_fsdp = end_fsdp["bytes_sent_by_kind"]["outer"]
    assert 0.9 < sent_fsdp / sent_rep < 1.1, (sent_fsdp, sent_rep)
    assert end_rep["bytes_sent_by_kind"]["outer_node"] > 0
    assert end_fsdp["bytes_sent_by_kind"].get("outer_node", 0) == 0


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_mid_interval_from_the_dcp_checkpoint_is_bit_exact(pool, name: str) -> None:
    root = pool["root"]
    ckpt = root / name / "checkpoints" / "step-00000006"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["kind"] == "dcp" and manifest["world_size"] == 4
    outer = torch.load(ckpt / "rank-state-00002.pt", weights_only=True)["outer"]
    assert outer["topology"]["outer_ranks"] == [0, 2]
    assert (outer["state"]["outer"]["pending"] is not None) == (name == "stream8")
    resumes = [r for r in _records(root / f"{name}_resumed") if r["kind"] == "resume"]
    assert [r["step"] for r in resumes] == [6]
    straight, resumed = _losses(root / name), _losses(root / f"{name}_resumed")
    assert {s: resumed[s] for s in range(7, STEPS + 1)} == {
        s: straight[s] for s in range(7, STEPS + 1)}
    for rank in pool["ranks"]:  # every rank's shards, before every step after the resume
        a, b = rank[name][1][6:], rank[f"{name}_resumed"][1]
        assert len(a) == len(b) == STEPS - 6
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert rank[name][0]["outer_syncs"] == rank[f"{name}_resumed"][0]["outer_syncs"]
    from moebit.inference.loading import load_model  # the final, agreed model

    x = load_model(root / name).state_dict()
    y = load_model(root / f"{name}_resumed").state_dict()
    assert all(torch.equal(x[k], y[k]) for k in x)
