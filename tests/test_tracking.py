"""Experiment tracking: a real run's records reach TensorBoard; a missing package is named."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from moebit.cli import main as cli_main
from moebit.cli.train import parse_train_args
from moebit.runs import tracking
from moebit.testing import run_on_ranks
from moebit.training.config import TrainConfig, build

NEEDS_TB = "tensorboard is an optional extra: pip install 'moebit[track]'"


def _read_events(log_dir: Path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason=NEEDS_TB)
    acc = event_accumulator.EventAccumulator(
        str(log_dir), size_guidance={event_accumulator.SCALARS: 0,
                                     event_accumulator.HISTOGRAMS: 0,
                                     event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def _train_body(rank: int, world: int, cfg_dict: dict, run_dir: str):
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train as _train

    return _train(build(cfg_dict), Path(run_dir), init_from_env("cpu"))


def test_two_rank_moe_run_writes_tensorboard_events(small_corpus: Path, tmp_path: Path):
    pytest.importorskip("tensorboard", reason=NEEDS_TB)
    cfg = {"data": str(small_corpus), "n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
           "batch_size": 4, "steps": 6, "warmup_steps": 2, "eval_every": 6, "eval_batches": 1,
           "log_every": 3, "dtype": "fp32", "samples": 0, "num_experts": 4, "threads": 1,
           "tensorboard": True}
    run_on_ranks(_train_body, 2, args=(cfg, str(tmp_path)), timeout=180)
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 only
    acc = _read_events(tmp_path / "tensorboard")
    scalars = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "comm/step_bytes_sent", "comm/step_bytes_sent/grad_allreduce", "moe/aux_loss",
                "moe/drop_rate", "moe/load_max_over_mean/block0", "eval/val_loss",
                "end/val_loss", "events/start", "events/end"):
        assert tag in scalars, (tag, sorted(scalars))
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    logged = acc.Scalars("train/loss")
    assert [e.step for e in logged] == [r["step"] for r in train] == [3, 6]
    for e, r in zip(logged, train, strict=True):
        assert e.value == pytest.approx(r["loss"], rel=1e-6)
    # the per-collective bytes add up to the total of the step
    by_op = sum(acc.Scalars(t)[-1].value for t in scalars if t.startswith("comm/step_bytes_sent/"))
    assert by_op == pytest.approx(train[-1]["step_bytes_sent"], rel=1e-6)
    hist = acc.Histograms("moe/expert_load/block0")
    assert [h.step for h in hist] == [3, 6]
    assert list(hist[-1].histogram_value.bucket) == train[-1]["expert_load"][0]


def test_every_kind_of_record_is_accepted(tmp_path: Path):
    pytest.importorskip("tensorboard", reason=NEEDS_TB)
    (tb,) = tracking.open_trackers(TrainConfig(tensorboard=True), tmp_path)
    records = [
        {"kind": "start", "n_params": 1000, "optimizer": "onebit_adam", "world_size": 2},
        {"kind": "resume", "step": 2, "from": "ckpt", "world_size": 2, "resharded": False},
        {"kind": "train", "step": 4, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7,
         "tokens_per_s": 900.0, "collectives": 3, "comm_stage": "compressed",
         "step_bytes_sent": 300.0, "step_bytes_by_op": {"onebit.phase1": 100.0, "onebit.phase2": 200.0},
         "aux_loss": 0.01, "drop_rate": 0.1, "kd_loss": 1.5, "expert_load": [[0, 0, 0], [5, 0, 1]]},
        {"kind": "nan", "step": 5, "loss": math.nan, "grad_norm": math.inf, "action": "skip"},
        {"kind": "freeze", "step": 6, "optimizer": "OnebitAdam", "clipped_frac_before": 0.25},
        {"kind": "kd_stop", "step": 7, "rule": "fraction", "reason": "KD ran its share"},
        {"kind": "eval", "step": 8, "val_loss": 2.0},
        {"kind": "end", "steps": 8, "val_loss": 2.0, "frozen_at": None, "samples": ["def f():"]},
        {"kind": "something_new", "step": 9, "x": 1},
    ]
    for r in records:
        tb.log(r)
    tb.close()
    acc = _read_events(tmp_path / "tensorboard")
    scalars = set(acc.Tags()["scalars"])
    assert {"train/kd_loss", "comm/collectives", "comm/step_bytes_sent/onebit.phase2",
            "freeze/clipped_frac_before", "events/freeze", "events/kd_stop", "events/nan",
            "events/resume", "nan/loss", "something_new/x", "start/n_params"} <= scalars
    assert acc.Scalars("events/freeze")[0].step == 6
    assert acc.Scalars("end/val_loss")[0].step == 8
    assert math.isnan(acc.Scalars("nan/loss")[0].value)
    # an all-zero load (a block that routed nothing) is skipped, the other one is written
    assert set(acc.Tags()["histograms"]) == {"moe/expert_load/block1"}
    texts = set(acc.Tags()["tensors"])  # add_text is stored as a string tensor
    assert {"events/kd_stop/text_summary", "events/end/text_summary"} <= texts
    reason = acc.Tensors("events/kd_stop/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "KD ran its share" in reason


def test_tags_of_groups_fields_and_rejects_non_dicts():
    t = tracking.tags_of({"kind": "train", "step": 3, "loss": 1.0, "bytes_sent": 8,
                          "flag": True, "comm_stage": "exact"})
    assert t.step == 3 and t.scalars == {"train/loss": 1.0, "comm/bytes_sent": 8.0}
    assert t.text == {}
    with pytest.raises(TypeError, match="must be a dict"):
        tracking.tags_of(["kind", "train"])  # type: ignore[arg-type]


def test_no_tracker_asked_or_not_rank_zero(tmp_path: Path):
    assert tracking.open_trackers(TrainConfig(), tmp_path) == []
    assert tracking.open_trackers(TrainConfig(tensorboard=True), tmp_path, rank=1) == []
    assert not (tmp_path / "tensorboard").exists()


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``import package`` fail as if it were not installed, also where torch imports it.

    None in sys.modules makes ``import package`` raise ImportError and ``find_spec`` return
    None; torch's wrapper module is dropped so that its import runs again and fails.
    """
    wrapper = "torch.utils.tensorboard"
    for name in list(sys.modules):
        if name.split(".")[0] == package or name == wrapper or name.startswith(wrapper + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


def test_missing_tensorboard_names_the_package_and_the_extra(monkeypatch, tmp_path: Path):
    _hide(monkeypatch, "tensorboard")
    cfg = TrainConfig(tensorboard=True)
    with pytest.raises(tracking.TrackingUnavailable, match=r"'tensorboard' package") as e:
        tracking.open_trackers(cfg, tmp_path)
    assert "pip install 'moebit[track]'" in str(e.value) and "pip install tensorboard" in str(e.value)
    with pytest.raises(tracking.TrackingUnavailable, match=r"moebit\[track\]"):
        tracking.require(cfg)  # what `moebit train` checks before launching ranks
    tracking.require(TrainConfig())  # not asked for: no error


def test_missing_wandb_names_the_package_and_the_extra(monkeypatch, tmp_path: Path):
    _hide(monkeypatch, "wandb")
    with pytest.raises(tracking.TrackingUnavailable, match=r"pip install 'moebit\[wandb\]'"):
        tracking.open_trackers(TrainConfig(wandb=True), tmp_path)
    with pytest.raises(tracking.TrackingUnavailable, match="pip install wandb"):
        tracking.require(TrainConfig(wandb=True))


def test_cli_flags_exist_and_fail_before_launch(monkeypatch, small_corpus: Path, tmp_path: Path,
                                                capsys):
    cfg, _ = parse_train_args(["--tensorboard", "--no-wandb", "--data", str(small_corpus)])
    assert cfg.tensorboard is True and cfg.wandb is False
    _hide(monkeypatch, "tensorboard")
    run_dir = tmp_path / "run"
    rc = cli_main(["train", "--tensorboard", "--data", str(small_corpus), "--run-dir", str(run_dir)])
    assert rc == 2
    assert "pip install 'moebit[track]'" in capsys.readouterr().err
    assert not run_dir.exists()  # nothing written, no rank started


def test_wandb_offline_run_writes_its_files(tmp_path: Path):
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'moebit[wandb]'")
    (wb,) = tracking.open_trackers(TrainConfig(wandb=True), tmp_path)
    wb.log({"kind": "train", "step": 1, "loss": 2.0, "expert_load": [[3, 1]]})
    wb.log({"kind": "kd_stop", "step": 2, "reason": "done"})
    wb.log({"kind": "eval", "step": 3, "val_loss": 1.5})  # W&B commits step 2 on a later step
    assert {"train/loss", "moe/expert_load/block0", "events/kd_stop",
            "events/kd_stop/text"} <= set(wb.run.summary.keys())
    wb.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path: Path):
    pytest.importorskip("tensorboard", reason=NEEDS_TB)
    cfg = TrainConfig(tensorboard=True)
    (first,) = tracking.open_trackers(cfg, tmp_path)
    first.log({"kind": "start", "n_params": 10})
    for step in (2, 4, 6):
        first.log({"kind": "train", "step": step, "loss": float(step)})
    first.close()  # a crash after step 6; the newest checkpoint is at step 3
    (second,) = tracking.open_trackers(cfg, tmp_path)
    second.log({"kind": "resume", "step": 3, "from": "checkpoints/step-00000003"})
    for step in (4, 6):
        second.log({"kind": "train", "step": step, "loss": -float(step)})
    second.close()
    loss = _read_events(tmp_path / "tensorboard").Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(2, 2.0), (4, -4.0), (6, -6.0)]


def _distill_body(rank: int, world: int, t_dict: dict, t_run: str, s_dict: dict, d_dict: dict,
                  s_run: str):
    from moebit.comm.collectives import init_from_env
    from moebit.distill.run import DistillConfig, distill
    from moebit.training.loop import train as _train

    _train(build(t_dict), Path(t_run), init_from_env("cpu"))
    Path(s_run).mkdir(parents=True, exist_ok=True)
    return distill(build(s_dict), DistillConfig.from_dict(d_dict), Path(s_run), init_from_env("cpu"))


def test_distillation_logs_kd_loss_and_the_kd_stop_event(small_corpus: Path, tmp_path: Path):
    pytest.importorskip("tensorboard", reason=NEEDS_TB)
    from moebit.distill.run import DistillConfig, student_train_config

    t_cfg = build({"data": str(small_corpus), "n_layer": 2, "n_head": 2, "d_model": 32,
                   "block_size": 32, "batch_size": 4, "steps": 4, "warmup_steps": 0,
                   "eval_every": 100, "eval_batches": 1, "log_every": 2, "dtype": "fp32",
                   "samples": 0, "threads": 1})
    t_run, s_run = tmp_path / "teacher", tmp_path / "student"
    t_run.mkdir()
    (t_run / "config.json").write_text(json.dumps(t_cfg.to_dict()))
    d = DistillConfig(teacher=str(t_run), student_layers=1, kd_stop_fraction=0.5,
                      kd_stop_rule="fraction")
    s_cfg, keep = student_train_config(t_cfg, d, {"steps": 4, "log_every": 1, "eval_every": 4,
                                                  "tensorboard": True})
    d.keep_layers = keep
    run_on_ranks(_distill_body, 1, args=(t_cfg.to_dict(), str(t_run), s_cfg.to_dict(),
                                         d.to_dict(), str(s_run)), timeout=120)
    assert not (t_run / "tensorboard").exists()  # the teacher run did not ask for it
    acc = _read_events(s_run / "tensorboard")
    assert [e.step for e in acc.Scalars("train/kd_loss")] == [1, 2]  # KD for half of 4 steps
    assert [e.step for e in acc.Scalars("events/kd_stop")] == [2]
    assert "events/kd_stop/text_summary" in acc.Tags()["tensors"]
