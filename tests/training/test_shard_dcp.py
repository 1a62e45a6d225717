"""DCP checkpoints of sharded models: bit-exact resume, loading at another world size,
the unsharded export, and a corrupted file refused by name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from shard_toys import batch, loss_of, tiny_gpt

from moebit.checkpoint.files import CheckpointError
from moebit.testing import run_on_ranks
from moebit.training.dcp import full_state_dict, load_sharded, save_sharded
from moebit.training.sharding import ShardConfig, shard_model

PROBE = torch.arange(2 * 15).reshape(2, 15) % 256


def _setup(ep: int, seed: int = 0, shard: str = "fsdp", rs: str = "none"):
    cfg = ShardConfig(shard, local_world_size=2, rs_compress=rs)
    model = shard_model(tiny_gpt(ep, seed=seed), cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(model, opt, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(model, batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _resume_is_bit_exact(rank: int, ep: int, ckpt: Path, rs: str = "none") -> bool:
    """3 steps, save, 3 more; a model from another seed loads the save and repeats them."""
    model, opt = _setup(ep, rs=rs)
    _steps(model, opt, rank, range(3))
    save_sharded(ckpt, model, opt, extra={"step": 3})
    want = _steps(model, opt, rank, range(3, 6))
    final = full_state_dict(model)
    model2, opt2 = _setup(ep, seed=1, rs=rs)
    extra = load_sharded(ckpt, model2, opt2)
    got = _steps(model2, opt2, rank, range(3, 6))
    final2 = full_state_dict(model2)
    same = extra == {"step": 3} and want == got
    return same and all(torch.equal(final[k], final2[k]) for k in final)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROBE).logits


def _saved_at_two(rank: int, world: int, root: str) -> dict:
    root_p = Path(root)
    out = {"resume_dense": _resume_is_bit_exact(rank, 0, root_p / "resume"),
           "resume_int8": _resume_is_bit_exact(rank, 0, root_p / "resume_int8", "int8")}
    for ep in (0, 2):
        model, opt = _setup(ep)
        _steps(model, opt, rank, range(2))
        save_sharded(root_p / f"ep{ep}", model, opt, extra={"ep": ep})
        out[f"logits{ep}"] = _logits(model)
    names = sorted(os.listdir(root_p))
    out["folders"] = names  # no .tmp left behind
    return out


def _loaded_at_four(rank: int, world: int, root: str) -> dict:
    root_p = Path(root)
    out: dict = {"resume_moe": _resume_is_bit_exact(rank, 2, root_p / "resume4")}
    for ep in (0, 2):
        model, opt = _setup(ep, seed=7)
        out[f"extra{ep}"] = load_sharded(root_p / f"ep{ep}", model, opt)
        out[f"logits{ep}"] = _logits(model)
        weights = full_state_dict(model)
        save_sharded(root_p / f"ep{ep}_at4", model)
        if rank == 0:  # the export loads into one unsharded process's model
            plain = tiny_gpt(1 if ep else 0, seed=3)
            plain.load_state_dict(weights)
            out[f"export{ep}"] = _logits(plain)
            out[f"disk{ep}"] = _on_disk_is_global(root_p / f"ep{ep}_at4", weights)
    out["hsdp"] = _hsdp_round_trip(rank, root_p / "hsdp")
    bad = root_p / "bad"
    if rank == 0:
        shutil.copytree(root_p / "ep0", bad)
        victim = sorted(p for p in bad.iterdir() if p.suffix == ".distcp")[-1]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    model, opt = _setup(0)
    try:
        load_sharded(bad, model, opt)
        out["corrupt"] = None
    except CheckpointError as e:
        out["corrupt"] = str(e)
    return out


def _hsdp_round_trip(rank: int, folder: Path) -> bool:
    """hsdp (2 nodes of 2, ep 2: experts replicated across nodes) saves once per replica
    set; the folder loads into fsdp (ep 2 x efsdp 2) with the same weights and logits."""
    model, opt = _setup(2, shard="hsdp")
    _steps(model, opt, rank, range(2))
    save_sharded(folder, model, opt)
    weights, logits = full_state_dict(model), _logits(model)
    other, other_opt = _setup(2, seed=5)
    load_sharded(folder, other, other_opt)
    again = full_state_dict(other)
    same = all(torch.equal(weights[k], again[k]) for k in weights)
    return same and torch.allclose(_logits(other), logits, rtol=0, atol=1e-5)


def _on_disk_is_global(folder: Path, weights: dict[str, torch.Tensor]) -> bool:
    """Read a world-4 save in this one process: every tensor, experts included, is the
    global (unsharded) tensor in its global order."""
    plain = {"model": {k: torch.empty_like(v) for k, v in weights.items()}}
    dcp.load(plain, checkpoint_id=folder, no_dist=True)
    return all(torch.equal(plain["model"][k], v) for k, v in weights.items())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    root = str(tmp_path_factory.mktemp("dcp"))
    two = run_on_ranks(_saved_at_two, 2, args=(root,), timeout=240)
    four = run_on_ranks(_loaded_at_four, 4, args=(root,), timeout=300)
    return two, four


def test_resume_from_dcp_is_bit_exact(runs) -> None:
    two, four = runs
    assert all(r["resume_dense"] for r in two)
    assert all(r["resume_moe"] for r in four)  # ep 2 x efsdp 2: expert state row views
    assert all(r["resume_int8"] for r in two)  # the error-feedback residuals come back too


def test_save_is_atomic_and_leaves_no_temporary_folder(runs) -> None:
    assert runs[0][0]["folders"] == ["ep0", "ep2", "resume", "resume_int8"]


@pytest.mark.parametrize("ep", [0, 2])
def test_a_checkpoint_saved_at_world_2_gives_equal_logits_at_world_4(runs, ep: int) -> None:
    two, four = runs
    for r in four:
        assert r[f"extra{ep}"] == {"ep": ep}
        torch.testing.assert_close(r[f"logits{ep}"], two[0][f"logits{ep}"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("ep", [0, 2])
def test_full_state_dict_on_rank_0_is_the_unsharded_model(runs, ep: int) -> None:
    two, four = runs
    assert four[0][f"disk{ep}"]  # and a world-4 save holds exactly those global tensors
    torch.testing.assert_close(four[0][f"export{ep}"], two[0][f"logits{ep}"], rtol=0, atol=1e-5)


def test_a_corrupted_shard_is_refused_by_name_on_every_rank(runs) -> None:
    for r in runs[1]:
        assert r["corrupt"] is not None and ".distcp is corrupted" in r["corrupt"]


def test_an_hsdp_checkpoint_loads_into_fsdp_with_the_same_weights(runs) -> None:
    assert all(r["hsdp"] for r in runs[1])
