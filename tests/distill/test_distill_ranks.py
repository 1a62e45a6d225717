"""Distillation on 2 gloo ranks with expert parallelism (ep 2), and the CLI end to end."""

import json
from pathlib import Path

import pytest
import torch

from moebit.distill.run import DISTILL_FILE, DistillConfig, DistillError, student_train_config
from moebit.testing import run_on_ranks
from moebit.training.config import build


def teacher_cfg(corpus: Path) -> dict:
    return {"data": str(corpus), "n_layer": 4, "n_head": 2, "d_model": 32, "block_size": 32,
            "batch_size": 4, "steps": 12, "lr": 3e-3, "warmup_steps": 0, "min_lr_ratio": 1.0,
            "eval_every": 100, "eval_batches": 2, "log_every": 4, "dtype": "fp32", "samples": 0,
            "num_experts": [2, 4], "moe_residual": True, "ep_size": 2}


def _teacher_then_students(rank: int, world: int, t_dict: dict, t_run: str, jobs: list):
    """Train the teacher, then several distillations from it, in one spawn (one import of
    torch per rank); each job is (student config dict, distill dict, run folder)."""
    from moebit.comm.collectives import init_from_env
    from moebit.distill.run import distill
    from moebit.training.loop import train

    train(build(t_dict), Path(t_run), init_from_env("cpu"))
    out = []
    for cfg_dict, d_dict, run_dir in jobs:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        out.append(distill(build(cfg_dict), DistillConfig.from_dict(d_dict), Path(run_dir),
                           init_from_env("cpu")))
    return out


@pytest.fixture(scope="module")
def distilled(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """(teacher run, folder of the student runs, per-rank results of the student runs)."""
    root = tmp_path_factory.mktemp("mos")
    run = root / "teacher"
    run.mkdir()
    t_cfg = build(teacher_cfg(small_corpus))
    (run / "config.json").write_text(json.dumps(t_cfg.to_dict()))
    # (a) a student as deep as the teacher, fp32 everywhere: its init must reproduce the
    #     teacher's validation loss, so every rank received its own experts' weights.
    full = DistillConfig(teacher=str(run), student_layers=4, teacher_dtype="fp32")
    cfg_a, _ = student_train_config(t_cfg, full, {"steps": 1})
    # (b) the real thing: 2 of 4 blocks, KD for 40% of 10 steps, logged every step.
    d = DistillConfig(teacher=str(run), student_layers=2, kd_stop_fraction=0.4,
                      kd_stop_rule="fraction", kd_weight=1.0, temperature=2.0)
    cfg_b, keep = student_train_config(t_cfg, d, {"steps": 10, "log_every": 1, "eval_every": 5})
    d.keep_layers = keep
    # (c) the catch-up rule: a full-depth copy of an undertrained teacher passes it within
    #     a few steps of training on data; KD must stop at the first check where it has.
    cu = DistillConfig(teacher=str(run), student_layers=4, kd_stop_fraction=1.0,
                       kd_stop_rule="catch-up", kd_check_every=2)
    cfg_c, _ = student_train_config(t_cfg, cu, {"steps": 8, "log_every": 1, "lr": 1e-2})
    jobs = [(cfg_a.to_dict(), full.to_dict(), str(root / "a")),
            (cfg_b.to_dict(), d.to_dict(), str(root / "b")),
            (cfg_c.to_dict(), cu.to_dict(), str(root / "c"))]
    res = run_on_ranks(_teacher_then_students, 2, args=(t_cfg.to_dict(), str(run), jobs),
                       timeout=200)
    return run, root, res


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ep2_distillation_stage_switch_and_sharded_init(distilled):
    _, root, res = distilled
    (a0, b0, _), (a1, b1, _) = res
    start_a = _records(root / "a")[0]
    assert start_a["init_val_loss"] == pytest.approx(start_a["teacher_val_loss"], abs=1e-5)

    recs = _records(root / "b")
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "start" and kinds[-1] == "end" and "eval" in kinds
    start = recs[0]
    assert start["keep_layers"] == [0, 3] and start["kd_steps"] == 4
    assert start["teacher_params"] > start["n_params"]
    stops = [r for r in recs if r["kind"] == "kd_stop"]
    assert len(stops) == 1 and stops[0]["step"] == 4
    trains = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in trains if "kd_loss" in r] == [1, 2, 3, 4]
    assert all(r["kd_loss"] > 0 for r in trains if "kd_loss" in r)
    assert recs.index(stops[0]) > kinds.index("train") + 3  # logged after step 4's record
    assert b0["val_loss"] == pytest.approx(b1["val_loss"], abs=1e-4)
    assert b0["kd_steps"] == 4 and a0["steps"] == 1 and a1["steps"] == 1
    # the checkpoint is an ordinary ep-2 student run: ranks hold different experts
    ck = root / "b" / "checkpoints" / "step-00000010"
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["model_config"]["n_layer"] == 2 and manifest["model_config"]["num_experts"] == [4]
    s0, s1 = (torch.load(ck / f"rank-0000{r}.pt", weights_only=True)["model"] for r in range(2))
    experts = [k for k in s0 if ".experts." in k]
    assert experts and all(not torch.equal(s0[k], s1[k]) for k in experts)
    assert all(torch.equal(s0[k], s1[k]) for k in s0 if k not in experts)


def test_catch_up_rule_stops_kd_when_the_student_reaches_the_teacher(distilled):
    _, root, res = distilled
    recs = _records(root / "c")
    stops = [r for r in recs if r["kind"] == "kd_stop"]
    assert len(stops) == 1 and stops[0]["rule"] == "catch-up", stops
    at = stops[0]["step"]
    assert at % 2 == 0 and 2 <= at < 8
    assert stops[0]["val_loss"] <= recs[0]["teacher_val_loss"]
    kd_steps = [r["step"] for r in recs if r["kind"] == "train" and "kd_loss" in r]
    assert kd_steps == list(range(1, at + 1))
    assert res[0][2]["kd_steps"] == at == res[1][2]["kd_steps"]


def test_cli_launches_ranks_and_refuses_bad_students(distilled, tmp_path: Path):
    teacher_run = distilled[0]
    from moebit.cli.args import UsageError
    from moebit.cli.distill import main, parse_args
    from moebit.runs.report import report

    base = ["--teacher", str(teacher_run), "--student-layers", "2"]
    with pytest.raises(UsageError, match="--d-model cannot be set"):
        parse_args(base + ["--d-model", "64"])
    with pytest.raises(DistillError, match="student block 1 is an MoE block"):
        parse_args(base + ["--keep-layers", "0,2"])
    with pytest.raises(DistillError, match="not a run folder"):
        parse_args(["--teacher", str(tmp_path), "--student-layers", "2"])
    run = tmp_path / "nokd"
    # one rank, ep 1: the ep-2 teacher's experts are regathered onto a single rank
    assert main(base + ["--no-kd", "--steps", "3", "--nproc", "1", "--ep-size", "1",
                        "--threads", "1", "--run-dir", str(run)]) == 0
    assert json.loads((run / DISTILL_FILE).read_text())["no_kd"] is True
    recs = _records(run)
    assert any(r["kind"] == "kd_stop" and r["step"] == 0 for r in recs)
    assert not any("kd_loss" in r for r in recs if r["kind"] == "train")
    assert (run / "loss.png").is_file()
    table, _ = report([str(teacher_run), str(run)], str(tmp_path))
    assert "nokd" in table and "teacher" in table


def _distill_with_nan_on_rank1(rank: int, world: int, cfg_dict: dict, d_dict: dict,
                               run_dir: str) -> str:
    """Rank 1 alone gets a NaN loss at step 3, after 1-bit Adam's freeze: no exact gradient
    average, and no expert parallelism, so nothing carries the NaN to rank 0's gradients."""
    from moebit.comm.collectives import init_from_env
    from moebit.distill.run import distill
    from moebit.training.grads import NonFiniteLoss

    from toys import poison_gpt_loss

    poison_gpt_loss(rank, on_rank=1, at_call=3)
    try:
        distill(build(cfg_dict), DistillConfig.from_dict(d_dict), Path(run_dir),
                init_from_env("cpu"))
    except NonFiniteLoss as e:
        return f"stopped: {e}"
    return "finished"


def test_a_nan_on_one_rank_stops_every_rank(distilled, small_corpus: Path, tmp_path: Path):
    """Without agreement the healthy rank would block in the optimizer's collective until
    the process-group timeout; every rank must raise the same error at the same step."""
    teacher_run = distilled[0]
    t_cfg = build(teacher_cfg(small_corpus))
    d = DistillConfig(teacher=str(teacher_run), student_layers=2)
    # ep 1: with ep 2 the MoE's all-to-all would carry the NaN to rank 0 in the backward
    cfg, keep = student_train_config(t_cfg, d, {"steps": 6, "optimizer": "onebit_adam",
                                                "freeze_step": 1, "eval_every": 100,
                                                "ep_size": 1, "on_nan": "stop"})
    d.keep_layers = keep
    res = run_on_ranks(_distill_with_nan_on_rank1, 2,
                       args=(cfg.to_dict(), d.to_dict(), str(tmp_path)), timeout=90)
    assert all(r.startswith("stopped: non-finite loss or gradient at step 3") for r in res), res
