"""``moebit plan memory``: per-rank memory replicated and sharded, against the bytes a real
model and optimizer hold, and the refusal of a plan that does not fit."""

from __future__ import annotations

import json

import pytest
import torch

from moebit.cli import main
from moebit.models.registry import build_model
from moebit.plan.benchmode import parse_train_flags
from moebit.plan.memory import count, parse_size, plan_memory, rank_memory
from moebit.plan.spec import SpecError
from moebit.training.shard_memory import state_bytes_per_rank

MODEL = ["--n-layer", "2", "--n-head", "2", "--d-model", "64", "--block-size", "32",
         "--batch-size", "2"]
MOE = [*MODEL, "--num-experts", "4", "--moe-every", "1", "--ep-size", "2"]


def test_replicated_state_is_what_a_real_model_and_adam_hold() -> None:
    cfg = parse_train_flags(MODEL)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    opt.step()
    real = state_bytes_per_rank(model, opt)
    plan = rank_memory(cfg, count(cfg), 4, 4, "none")
    assert plan.params == real.params and plan.grads == real.grads
    assert abs(plan.optimizer - real.optimizer) <= 4 * len(opt.state)  # Adam's step scalars


def test_sharded_state_splits_over_the_shard_group_experts_included() -> None:
    cfg = parse_train_flags(MOE)
    c = count(cfg)
    none, fsdp, hsdp = plan_memory(cfg, 8, 4)
    assert [r.shard for r in (none, fsdp, hsdp)] == ["none", "fsdp", "hsdp"]
    assert none.params == (c.dense + c.experts // 2) * 4  # experts over ep 2
    assert fsdp.params == int((c.dense + c.experts) / 8 * 4)  # everything over the world
    assert hsdp.params == int((c.dense + c.experts) / 4 * 4)  # over a node
    assert fsdp.optimizer == 2 * fsdp.params and fsdp.gathered > 0 == none.gathered
    assert fsdp.activations == none.activations  # activations are not sharded
    kept = parse_train_flags([*MOE, "--shard", "fsdp", "--no-reshard-after-forward"])
    assert rank_memory(kept, c, 8, 4, "fsdp").gathered > fsdp.gathered
    one = parse_train_flags([*MOE, "--shard", "fsdp", "--shard-unit", "model"])
    whole = c.dense + c.experts / 2  # a rank gathers its ep rank's experts and all the rest
    assert rank_memory(one, c, 8, 4, "fsdp").gathered == int(whole * 8)  # weights + gradient
    assert rank_memory(one, c, 8, 4, "fsdp").params == fsdp.params  # the same at rest


def test_a_plan_that_does_not_fit_is_refused_in_one_line(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "memory", "--nproc", "4", "--memory-per-rank", "2GiB", "--json", str(out),
            "--", "--n-layer", "12", "--d-model", "768", "--batch-size", "4", "--block-size", "128"]
    assert main(args) == 2
    cap = capsys.readouterr()
    assert "none " in cap.out and "fsdp " in cap.out  # both rows printed
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("moebit plan: error: memory: shard=none")
    assert "more than --memory-per-rank 2.00 GiB; shard=fsdp fits" in err
    rows = {r["shard"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fsdp"]["total"] <= 2 * 2**30 < rows["none"]["total"]
    assert main([*args[:8], *args[8:], "--shard", "fsdp"]) == 0


def test_sizes_parse_with_units_and_bad_ones_name_the_flag() -> None:
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    for bad in ("lots", "12 parsecs", "0GiB"):
        with pytest.raises(SpecError, match="--memory-per-rank"):
            parse_size(bad)
