"""Loading checkpoints for generation: round trip, resharding, and clear errors for bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moebit.checkpoint import CheckpointError, latest
from moebit.inference.generate import generate
from moebit.inference.loading import load_model, resolve_checkpoint
from moebit.models.gpt import GPT
from moebit.testing import run_on_ranks

from toys import save_run


def _save_run(run: Path, **overrides) -> GPT:
    return save_run(run, {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
                          **overrides}, step=7)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("moe_run")
    _save_run(run, num_experts=4, moe_every=1)
    return run


def test_round_trip_same_text(moe_run: Path) -> None:
    torch.set_num_threads(1)
    m = load_model(moe_run)
    torch.manual_seed(0)
    from moebit.training.config import build as b

    ref = GPT(b({"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
                 "num_experts": 4, "moe_every": 1}).model_config())
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), ref.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert not m.training
    assert resolve_checkpoint(moe_run) == latest(moe_run)
    assert load_model(latest(moe_run)).config == m.config
    assert generate(m, ["ab"], max_new_tokens=5, temperature=0) == generate(
        ref, ["ab"], max_new_tokens=5, temperature=0)


def _ep_load_body(rank: int, world: int, run: str) -> list[str]:
    torch.set_num_threads(1)
    m = load_model(run, ep_size=world, rank=rank)
    assert m.blocks[0].ffn.experts.num_local == 4 // world
    return generate(m, ["ab", "cde", "f"], max_new_tokens=6, temperature=0)


def test_load_resharded_on_two_ranks(moe_run: Path) -> None:
    torch.set_num_threads(1)
    want = generate(load_model(moe_run), ["ab", "cde", "f"], max_new_tokens=6, temperature=0)
    r0, r1 = run_on_ranks(_ep_load_body, world=2, args=(str(moe_run),), timeout=60)
    assert r0 == r1 == want


def test_missing_and_non_moebit_paths(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    f = tmp_path / "model.pt"
    torch.save({"weight": torch.zeros(2)}, f)
    with pytest.raises(CheckpointError, match="is a file, not a moebit run"):
        load_model(f)
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="not a moebit run or checkpoint folder"):
        load_model(tmp_path / "other")
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_model(tmp_path / "empty_run")


def test_corrupted_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _save_run(run)
    d = latest(run)
    shard = d / "rank-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted: checksum mismatch"):
        load_model(run)
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(run)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupted"):
        load_model(d)


def test_checkpoint_of_another_model_type(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _save_run(run)
    d = latest(run)
    manifest = json.loads((d / "manifest.json").read_text())
    # another architecture's manifest: keys a GPT does not have
    foreign = {**manifest, "model_config": {"hidden_size": 768, "num_attention_heads": 12}}
    (d / "manifest.json").write_text(json.dumps(foreign))
    with pytest.raises(CheckpointError, match="another model type"):
        load_model(d)
    (d / "manifest.json").write_text(json.dumps({"format": 1, "step": 3}))
    with pytest.raises(CheckpointError, match="not a moebit checkpoint"):
        load_model(d)
    # a manifest that claims an MoE model over a dense model's weights
    claims = {**manifest, "model_config": {**manifest["model_config"], "num_experts": 4,
                                           "moe_every": 1}}
    (d / "manifest.json").write_text(json.dumps(claims))
    with pytest.raises(CheckpointError, match="holds weights of another model"):
        load_model(d)


def test_generate_command(moe_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moebit.cli.generate import main

    n = torch.get_num_threads()
    try:
        rc = main([str(moe_run), "--prompt", "ab", "--prompt", "c", "--max-new-tokens", "5",
                   "--temperature", "0", "--threads", "1", "--quantize", "int8",
                   "--json", str(tmp_path / "out.json")])
    finally:
        torch.set_num_threads(n)
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["prompts"] == ["ab", "c"] and out["new_tokens"] == 10
    assert cap.out.startswith("ab" + out["texts"][0])
    assert "int8 experts: 2 MoE layers" in cap.err and "int8 dense projections" in cap.err
    n = torch.get_num_threads()
    try:
        rc = main([str(moe_run), "--prompt", "ab", "--max-new-tokens", "3", "--temperature",
                   "0", "--threads", "1", "--quantize", "int4"])
    finally:
        torch.set_num_threads(n)
    assert rc == 0 and "int4 experts: 2 MoE layers" in capsys.readouterr().err
    assert main([str(tmp_path), "--prompt", "x"]) == 2
    assert "not a moebit run or checkpoint folder" in capsys.readouterr().err
    dense = tmp_path / "dense"
    _save_run(dense)
    assert main([str(dense), "--prompt", "x", "--quantize", "int8", "--quantize-scope",
                 "experts"]) == 2
    assert "holds a dense model" in capsys.readouterr().err
    n = torch.get_num_threads()
    try:  # the default scope quantizes a dense model's projections
        rc = main([str(dense), "--prompt", "x", "--quantize", "int8", "--max-new-tokens", "3",
                   "--temperature", "0", "--threads", "1"])
    finally:
        torch.set_num_threads(n)
    assert rc == 0 and "int8 dense projections: 9 linears" in capsys.readouterr().err
    assert main([str(moe_run)]) == 2
    assert "at least one --prompt" in capsys.readouterr().err
