"""``moebit train``'s sharding flags: config keys and flags alike, and every refused
combination one line naming the key, before any rank starts (no process is spawned)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moebit.checkpoint import CheckpointError
from moebit.cli import main
from moebit.cli.train import check_training, parse_train_args
from moebit.training.config import ConfigError, build
from moebit.training.shard_loop import check_kind, shard_config

TINY = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--block-size", "32",
        "--steps", "2", "--dtype", "fp32"]


def test_the_flags_are_config_keys_and_reach_the_shard_config(tmp_path: Path) -> None:
    cfg, launch = parse_train_args([*TINY, "--nproc", "4", "--shard", "fsdp",
                                    "--no-reshard-after-forward", "--param-dtype", "bf16",
                                    "--reduce-dtype", "fp32", "--rs-compress", "int8",
                                    "--ag-compress", "bf16"])
    sc = shard_config(cfg)
    assert (sc.shard, sc.reshard_after_forward, sc.param_dtype, sc.reduce_dtype) == (
        "fsdp", False, "bf16", "fp32")
    assert (sc.rs_compress, sc.ag_compress) == ("int8", "bf16")
    flat = cfg.to_dict()  # what RUN/config.json holds, read back through the same path
    assert build(flat) == cfg
    file = tmp_path / "run.toml"
    file.write_text('shard = "fsdp"\nrs_compress = "bf16"\n')
    cfg, _ = parse_train_args(["--config", str(file), "--ag-compress", "int8"])
    assert (cfg.shard, cfg.rs_compress, cfg.ag_compress) == ("fsdp", "bf16", "int8")
    assert build({}).shard == "none" and build({}).reshard_after_forward


REFUSED = [
    (["--rs-compress", "int8"], "rs_compress: rs_compress=int8 compresses a sharded collective"),
    (["--ag-compress", "bf16"], "ag_compress: ag_compress=bf16 compresses"),
    (["--shard", "zero3"], "shard: must be one of none, fsdp, hsdp"),
    (["--shard", "fsdp", "--shard-unit", "layer"], "shard_unit: must be one of block, model"),
    (["--shard", "fsdp", "--shard-transport", "ring"],
     "shard_transport: must be one of auto, native, a2a"),
    (["--shard", "fsdp", "--param-dtype", "fp8"], "param_dtype: must be one of fp32, bf16, fp16"),
    (["--shard", "fsdp", "--optimizer", "onebit_adam"],
     "optimizer: optimizer 'onebit_adam' does not compose with shard=fsdp"),
    (["--shard", "fsdp", "--optimizer", "zero_one_adam"], "does not compose with shard=fsdp"),
    (["--shard", "hsdp", "--outer", "diloco", "--outer-every", "4"],
     "shard: outer=diloco does not compose with shard=hsdp"),
    (["--shard", "fsdp", "--outer", "diloco", "--outer-every", "4", "--outer-group", "world"],
     "outer_group: outer_group=world with shard=fsdp makes every rank its own DiLoCo worker"),
    (["--shard", "hsdp"], "shard: hsdp needs more than one node: LOCAL_WORLD_SIZE=2"),
    (["--shard", "fsdp", "--nproc", "4", "--num-experts", "2", "--ep-size", "2"],
     "shard: 1 local experts (num_experts / ep_size) do not split over the 2"),
    (["--shard", "hsdp", "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1",
      "--num-experts", "4", "--ep-size", "4"], "shard: hsdp: ep_size=4 must divide the node size 2"),
]


@pytest.mark.parametrize("flags,said", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_refused_combinations_are_one_line_naming_the_key(flags, said, tmp_path) -> None:
    with pytest.raises(ConfigError) as e:
        cfg, launch = parse_train_args([*TINY, "--run-dir", str(tmp_path / "r"), *flags])
        check_training(cfg, launch)
    assert said in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()  # refused before the run folder was made


def test_the_command_prints_one_line_and_exits_2(capsys, tmp_path) -> None:
    code = main(["train", *TINY, "--shard", "fsdp", "--optimizer", "onebit_lamb",
                 "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("moebit train: error: optimizer: optimizer 'onebit_lamb' does not compose")


def test_a_checkpoint_resumes_only_under_its_own_kind(tmp_path: Path) -> None:
    d = tmp_path / "step-00000010"
    with pytest.raises(CheckpointError, match="is a sharded \\(DCP\\) checkpoint .*shard=none"):
        check_kind(d, {"kind": "dcp", "shard": "fsdp"}, build({}))
    with pytest.raises(CheckpointError, match="is a replicated checkpoint; this run has shard=fsdp"):
        check_kind(d, {"step": 10}, build({"shard": "fsdp"}))
    check_kind(d, {"kind": "dcp"}, build({"shard": "fsdp"}))
    check_kind(d, {"step": 10}, build({}))
