import json
from pathlib import Path

import pytest

from moebit.cli.args import UsageError
from moebit.cli.launch import check_rendezvous_port, prepare_run_dir, torchrun_args
from moebit.cli.train import launch_training, parse_train_args
from moebit.training.config import ConfigError, build, load_file


def test_defaults_then_file_then_flags(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text('steps = 50\nlr = 0.01\n[model]\nn_layer = 3\n')
    cfg, launch = parse_train_args(["--config", str(f), "--lr", "0.002", "--nproc", "3"])
    assert (cfg.steps, cfg.lr, cfg.model.n_layer) == (50, 0.002, 3)
    assert launch == {"nproc": 3}


def test_json_config(tmp_path: Path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"d_model": 64, "n_head": 2, "dtype": "fp32"}))
    assert build(load_file(str(f))).model.d_model == 64


def test_unknown_key_in_file_is_named(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("stepz = 5\n")
    with pytest.raises(ConfigError, match="unknown setting 'stepz'"):
        parse_train_args(["--config", str(f)])


def test_unknown_flag_is_named():
    with pytest.raises(UsageError, match="--nlayer"):
        parse_train_args(["--nlayer", "3"])


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--lr", "-1"], "lr"),
        (["--dtype", "fp8"], "dtype"),
        (["--beta2", "1.0"], "beta2"),
        (["--steps", "abc"], "steps"),
        (["--optimizer", "sgd"], "optimizer"),
        (["--d-model", "30", "--n-head", "4"], "d_model"),
        (["--freeze-step", "soon"], "freeze_step"),
    ],
)
def test_bad_values_name_the_key(flags, key):
    with pytest.raises(ConfigError, match=key):
        parse_train_args(flags)


def test_missing_or_unparsable_config_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such file"):
        load_file(str(tmp_path / "none.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_file(str(bad))


def test_freeze_step_defaults_to_a_fifth_of_the_run():
    cfg = build({"optimizer": "onebit_adam", "steps": 1000})
    assert cfg.resolved_freeze_step() == 200
    assert build({"freeze_step": "auto", "optimizer": "onebit_adam"}).resolved_freeze_step() == "auto"
    assert build({"optimizer": "adam"}).resolved_freeze_step() is None


def test_torchrun_args_single_and_multi_node(tmp_path: Path):
    single = torchrun_args({"nproc": 2}, "moebit.training.loop",
                           ["--resolved-config", str(tmp_path / "c.json")])
    assert "--standalone" in single and single[single.index("--nproc-per-node") + 1] == "2"
    multi = torchrun_args(
        {"nproc": 1, "nnodes": 2, "node_rank": 1, "rdzv_endpoint": "127.0.0.1:1234"},
        "moebit.training.loop", ["--resolved-config", str(tmp_path / "c.json")],
    )
    assert "--standalone" not in multi
    assert multi[multi.index("--rdzv-endpoint") + 1] == "127.0.0.1:1234"
    with pytest.raises(UsageError, match="rdzv-endpoint"):
        torchrun_args({"nnodes": 2}, "moebit.training.loop", ["--resolved-config", str(tmp_path / "c.json")])


def test_launch_refuses_bad_data_before_writing_anything(tmp_path: Path):
    from moebit.training.data import CorpusError

    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\x00\xff" * 100)
    run = tmp_path / "run"
    for data in (binary, tmp_path / "missing.txt"):
        cfg, launch = parse_train_args(["--data", str(data), "--run-dir", str(run)])
        with pytest.raises(CorpusError):
            launch_training(cfg, launch)
        assert not run.exists(), "nothing may be written for a run that cannot start"


def test_unwritable_run_dir_and_port_in_use(tmp_path: Path):
    import socket


    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg, _ = parse_train_args(["--run-dir", str(blocker / "run")])
    with pytest.raises(UsageError, match="not writable"):
        prepare_run_dir(cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UsageError, match=f"port {port} is already in use"):
            check_rendezvous_port({"nnodes": 2, "node_rank": 0,
                                   "rdzv_endpoint": f"127.0.0.1:{port}"})


def test_existing_run_is_not_overwritten(tmp_path: Path):

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    cfg, _ = parse_train_args(["--run-dir", str(tmp_path)])
    with pytest.raises(UsageError, match="already holds a run"):
        prepare_run_dir(cfg)


def test_auto_freeze_is_refused_before_launch_for_optimizers_without_the_rule():
    for name in ("zero_one_adam", "onebit_lamb"):
        with pytest.raises(ConfigError, match="freeze_step.*only onebit_adam"):
            build({"freeze_step": "auto", "optimizer": name})
    assert build({"freeze_step": "auto", "optimizer": "adam"}).resolved_freeze_step() is None
