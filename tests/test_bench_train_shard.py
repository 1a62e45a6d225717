"""``moebit bench train --shards`` and ``--rank-memory-cap``: the rows they make, a row
that does not fit the cap recorded with its error, and the sharding table (no ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moebit.bench.train import _jobs, parse
from moebit.bench.train_shard import (
    CAPPED_MALLOC,
    capped_env,
    format_shard_table,
    parse_shards,
    run_capped,
    shard_fields,
)


def test_each_shards_entry_is_a_row_with_its_train_flags(tmp_path: Path) -> None:
    assert parse_shards("none,fsdp,fsdp:rs=int8:ag=bf16,fsdp:unit=model:keep") == [
        ("none", []), ("fsdp", ["--shard", "fsdp"]),
        ("fsdp:rs=int8:ag=bf16", ["--shard", "fsdp", "--rs-compress", "int8",
                                  "--ag-compress", "bf16"]),
        ("fsdp:unit=model:keep", ["--shard", "fsdp", "--shard-unit", "model",
                                  "--no-reshard-after-forward"])]
    args, extra = parse(["--optimizers", "adam", "--shards", "none,fsdp:rs=int8", "--nproc", "4",
                         "--out", str(tmp_path), "--", "--n-layer", "2"])
    jobs = _jobs(args, extra, tmp_path)
    assert [label for label, _, _ in jobs] == ["adam shard=none", "adam shard=fsdp:rs=int8"]
    argv = jobs[1][1]
    assert argv[argv.index("--shard") + 1] == "fsdp" and "--rs-compress" in argv
    assert jobs[1][2].name == "adam-fsdp-rs=int8" and "--shard" not in jobs[0][1]


@pytest.mark.parametrize("bad,said", [("zero3", "the mode must be one of none, fsdp, hsdp"),
                                      ("fsdp:rs=int4", "is not rs=FMT or ag=FMT"),
                                      ("fsdp:unit=layer", "unit=U"),
                                      ("none:rs=int8", "is a setting of a sharded row")])
def test_a_bad_entry_is_named_before_any_run(bad: str, said: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=said):
        parse(["--shards", bad, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--rank-memory-cap"):
        parse(["--rank-memory-cap", "lots", "--out", str(tmp_path)])


def test_a_command_above_the_cap_fails_with_its_error_and_one_below_runs() -> None:
    grab = [sys.executable, "-c", "x = bytearray(3 << 30)"]
    err = run_capped(grab, 1 << 30, timeout=60)
    assert err is not None and "MemoryError" in err
    assert run_capped([sys.executable, "-c", "x = bytearray(1 << 20)"], 1 << 30, timeout=60) is None


def test_a_capped_command_maps_only_live_memory_unless_told_otherwise(monkeypatch) -> None:
    for key in CAPPED_MALLOC:
        monkeypatch.delenv(key, raising=False)
    check = [sys.executable, "-c", "import os, sys; sys.exit(0 if (os.environ['MALLOC_ARENA_MAX'],"
             " os.environ['MALLOC_MMAP_THRESHOLD_']) == ('2', '131072') else 3)"]
    assert run_capped(check, 1 << 30, timeout=60) is None
    assert capped_env({"MALLOC_ARENA_MAX": "8"})["MALLOC_ARENA_MAX"] == "8"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert run_capped(check, 1 << 30, timeout=60) == "exit 3: (no output)"


def test_the_table_compares_memory_bytes_and_loss_with_the_first_row() -> None:
    def recs(state: int, rs: int, exact: int, loss: float) -> list[dict]:
        return [{"kind": "train", "step": 20, "loss": loss},
                {"kind": "end", "state_bytes_per_rank": state, "peak_rss_mb": 400.0,
                 "bytes_sent_by_kind": {"rs": rs, "exact": exact, "ag": 2 * rs}}]
    rep = {**shard_fields(recs(4000, 0, 3000, 2.5), {}), "optimizer": "adam shard=none",
           "tokens_per_s_vs_first": 1.0}
    fsdp = {**shard_fields(recs(1000, 1500, 0, 2.500001), {"shard": "fsdp"}),
            "optimizer": "adam shard=fsdp", "tokens_per_s_vs_first": 0.93}
    assert fsdp["shard"] == "fsdp" and fsdp["grad_bytes"] == 1500 and fsdp["last_step"] == 20
    table = format_shard_table([rep, fsdp], [{"optimizer": "adam shard=none (capped)",
                                              "error": "exit 1: MemoryError"}])
    row = next(line for line in table.splitlines() if line.startswith("adam shard=fsdp"))
    assert "0.250x" in row and "2.000x" in row and "0.93x" in row and "1.00e-06" in row
    assert table.splitlines()[-1] == "adam shard=none (capped): FAILED: exit 1: MemoryError"
