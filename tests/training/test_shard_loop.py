"""Sharded training through the loop: ``train()`` with ``shard=fsdp`` on 2 gloo ranks.

One rank pool runs every training of this module (a spawn costs seconds): a replicated
run and an fsdp run of the same GPT (losses equal over 10 steps), a resume of the fsdp
run from its step-5 DCP checkpoint (bit-exact), and, when transformers is installed, a
Mixtral-style folder read per rank (the reads counted) and trained sharded (exported
back to a folder transformers loads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moebit.testing import run_on_ranks
from moebit.training.config import build

STEPS = 10
MIXTRAL = dict(vocab_size=256, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               num_local_experts=4, num_experts_per_tok=2)


def cfg_for(corpus: Path, run: Path, **kw) -> dict:
    cfg = {"data": str(corpus), "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
           "batch_size": 4, "steps": STEPS, "lr": 3e-3, "warmup_steps": 2, "eval_every": 100,
           "eval_batches": 1, "log_every": 1, "dtype": "fp32", "samples": 0, "run_dir": str(run)}
    return {**cfg, **kw}


def _hf_reads(rank: int, folder: str) -> dict:
    """Each rank's reads of a sharded load, and the weights they give (rank 0)."""
    import warnings

    from moebit.models.hf import HFDecoderConfig, build_empty, from_pretrained
    from moebit.models.hf.config import read_config
    from moebit.training.dcp import full_state_dict
    from moebit.training.shard_init import load_hf_sharded
    from moebit.training.sharding import ShardConfig, shard_model

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    cfg: HFDecoderConfig = read_config(Path(folder))
    model = shard_model(build_empty(cfg), ShardConfig("fsdp"))
    report = load_hf_sharded(model, folder)
    full = full_state_dict(model)
    same = None
    if rank == 0:
        want = from_pretrained(folder).state_dict()
        same = sorted(want) == sorted(full) and all(torch.equal(want[k], full[k]) for k in want)
    return {"reads": report.reads, "bytes": report.bytes_read, "same": same}


def _pool(rank: int, world: int, corpus: str, root: str, hf: str | None) -> dict:
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    info = init_from_env("cpu")
    base = Path(root)
    out: dict = {}
    out["rep"] = train(build(cfg_for(Path(corpus), base / "rep")), base / "rep", info)
    fsdp = cfg_for(Path(corpus), base / "fsdp", shard="fsdp", save_every=5)
    out["fsdp"] = train(build(fsdp), base / "fsdp", info)
    # one unit kept gathered from forward to backward, collectives through all-to-alls
    unit = cfg_for(Path(corpus), base / "unit", shard="fsdp", save_every=5, shard_unit="model",
                   reshard_after_forward=False, shard_transport="a2a")
    out["unit"] = train(build(unit), base / "unit", info)
    for run, name in ((fsdp, "fsdp"), (unit, "unit")):
        if rank == 0:  # the same run, resumed from its step-5 checkpoint
            shutil.copytree(base / name, base / f"{name}-resumed")
            shutil.rmtree(base / f"{name}-resumed" / "checkpoints" / f"step-{STEPS:08d}")
        dist.barrier()
        resumed = {**run, "run_dir": str(base / f"{name}-resumed"), "resume": True}
        out[f"{name}-resumed"] = train(build(resumed), base / f"{name}-resumed", info)
    if hf is not None:
        out["hf_reads"] = _hf_reads(rank, hf)
        cfg = cfg_for(Path(corpus), base / "hf_run", init_from=hf, shard="fsdp", steps=3,
                      block_size=16, batch_size=2)
        out["hf_run"] = train(build(cfg), base / "hf_run", info)
    return out


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def pool(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("shard_loop")
    hf = None
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        torch.manual_seed(0)
        hf_cfg = transformers.AutoConfig.for_model("mixtral", **MIXTRAL)
        transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(root / "hf")
        hf = str(root / "hf")
    ranks = run_on_ranks(_pool, 2, args=(str(small_corpus), str(root), hf), timeout=600)
    return {"root": root, "ranks": ranks, "hf": hf}


def test_fsdp_loss_equals_the_replicated_runs_over_10_steps(pool) -> None:
    rep, fsdp = _losses(pool["root"] / "rep"), _losses(pool["root"] / "fsdp")
    assert sorted(rep) == list(range(1, STEPS + 1)) and sorted(fsdp) == sorted(rep)
    for step in rep:
        assert abs(rep[step] - fsdp[step]) <= 1e-5, (step, rep[step], fsdp[step])
    assert rep[STEPS] < rep[1]  # it trained


def test_the_end_record_carries_state_bytes_and_peak_rss_for_every_run(pool) -> None:
    rep, fsdp = pool["ranks"][0]["rep"], pool["ranks"][0]["fsdp"]
    for end in (rep, fsdp):
        assert end["peak_rss_mb"] > 50
        parts = end["param_bytes_per_rank"] + end["grad_bytes_per_rank"]
        assert end["state_bytes_per_rank"] == parts + end["optimizer_bytes_per_rank"]
    assert rep["shard"] == "none" and fsdp["shard"] == "fsdp"
    # 2 ranks: each keeps about half of every tensor (FSDP pads a few rows)
    assert 0.45 < fsdp["state_bytes_per_rank"] / rep["state_bytes_per_rank"] <= 0.55
    # moebit plan memory predicts what the ranks measured
    from moebit.plan.memory import count, rank_memory

    cfg = build(cfg_for(Path("unused"), pool["root"] / "fsdp", shard="fsdp"))
    for end, shard in ((rep, "none"), (fsdp, "fsdp")):
        plan = rank_memory(cfg, count(cfg), 2, 2, shard)
        assert abs(plan.state - end["state_bytes_per_rank"]) <= 0.03 * end["state_bytes_per_rank"]
    from moebit.runs.tracking import tags_of  # TensorBoard / W&B mirror these fields

    assert {"end/state_bytes_per_rank", "end/peak_rss_mb"} <= set(tags_of(fsdp).scalars)
    on_disk = _records(pool["root"] / "fsdp")[-1]
    assert on_disk["kind"] == "end" and on_disk["state_bytes_per_rank"] == fsdp["state_bytes_per_rank"]


def test_a_sharded_run_checkpoints_with_dcp_and_resumes_bit_exact(pool) -> None:
    root = pool["root"]
    manifest = json.loads((root / "fsdp" / "checkpoints" / f"step-{STEPS:08d}" /
                           "manifest.json").read_text())
    assert manifest["kind"] == "dcp" and manifest["world_size"] == 2
    assert manifest["step"] == STEPS and manifest["config"]["shard"] == "fsdp"
    assert any(n.endswith(".distcp") for n in manifest["files"])
    from moebit.inference.loading import load_model

    for name in ("fsdp", "unit"):
        straight, resumed = _losses(root / name), _losses(root / f"{name}-resumed")
        assert [r for r in _records(root / f"{name}-resumed")
                if r["kind"] == "resume"][0]["step"] == 5
        assert ({s: resumed[s] for s in range(6, STEPS + 1)}
                == {s: straight[s] for s in range(6, STEPS + 1)}), name
        a = load_model(root / name).state_dict()
        b = load_model(root / f"{name}-resumed").state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_one_unit_through_all_to_alls_trains_as_the_replicated_run(pool) -> None:
    rep, unit = _losses(pool["root"] / "rep"), _losses(pool["root"] / "unit")
    assert sorted(unit) == sorted(rep)
    assert max(abs(rep[s] - unit[s]) for s in rep) <= 1e-5
    end, fsdp = pool["ranks"][0]["unit"], pool["ranks"][0]["fsdp"]
    assert end["shard_transports"] == {"rs": ["a2a"], "ag": ["a2a"]}
    assert fsdp["shard_transports"] == {"rs": ["native"], "ag": ["native"]}  # autotune off
    # measured at rest: the evaluation's gathered weights are resharded first
    assert end["state_bytes_per_rank"] == fsdp["state_bytes_per_rank"]


def test_eval_and_generate_read_a_sharded_checkpoint(pool) -> None:
    """``load_model`` (export, eval, generate, serve and the distillation teacher all
    go through it) gathers a DCP checkpoint in one process: the fsdp run's weights are
    the replicated run's."""
    from moebit.inference.generate import generate_tokens
    from moebit.inference.loading import load_model

    root = pool["root"]
    sharded, replicated = load_model(root / "fsdp"), load_model(root / "rep")
    a, b = sharded.state_dict(), replicated.state_dict()
    assert sorted(a) == sorted(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    ids = generate_tokens(sharded, [[100, 101]], max_new_tokens=4, seed=0, shard=False)
    assert len(ids.tokens[0]) == 4


def test_init_from_under_shard_reads_only_each_ranks_rows(pool) -> None:
    if pool["hf"] is None:
        pytest.skip("transformers is not installed (the hf extra)")
    from safetensors import safe_open

    reads = [r["hf_reads"] for r in pool["ranks"]]
    assert reads[0]["same"]  # the shards hold exactly the folder's weights
    with safe_open(str(Path(pool["hf"]) / "model.safetensors"), "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        total = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    # every row of every tensor read exactly once over the ranks; no rank reads it all
    rows: dict[str, list[int]] = {}
    for r in reads:
        for name, first, n in r["reads"]:
            rows.setdefault(name, []).extend(range(first, first + n))
    for name, shape in sizes.items():
        assert sorted(rows[name]) == list(range(shape[0])), name
    assert sum(r["bytes"] for r in reads) == total
    assert all(r["bytes"] <= 0.55 * total for r in reads)
    # per-expert layout: each rank opened only its 2 of the 4 experts of each layer
    for rank, r in enumerate(reads):
        experts = {n.split(".experts.")[1].split(".")[0] for n, _, _ in r["reads"] if ".experts." in n}
        assert experts == ({"0", "1"} if rank == 0 else {"2", "3"})


def test_export_from_a_sharded_hf_run_loads_in_transformers(pool, tmp_path: Path) -> None:
    if pool["hf"] is None:
        pytest.skip("transformers is not installed (the hf extra)")
    import transformers

    from moebit.cli.export import export
    from moebit.inference.loading import load_model

    run = pool["root"] / "hf_run"
    out = export(run, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    orig = transformers.AutoModelForCausalLM.from_pretrained(pool["hf"]).eval()
    mine = load_model(run)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, mine(ids).logits, atol=1e-4, rtol=0)
        assert (orig(ids).logits - mine(ids).logits).abs().max() > 1e-3  # it did train
