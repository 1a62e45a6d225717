"""Distillation has what training has: bit-exact resume (the KD stage included), the
whole-run counters, ``--on-nan skip``, the freeze record and gradient metrics, and the CLI's
``--resume``; all on 2 gloo ranks, the resume with expert parallelism (ep 2)."""

import json
from pathlib import Path

import pytest
import torch

from moebit.checkpoint import latest
from moebit.distill.run import DISTILL_FILE, DistillConfig, student_train_config
from moebit.testing import run_on_ranks
from moebit.training.config import build

N = 4  # the split run stops after N steps and resumes to 2N


def teacher_cfg(corpus: Path) -> dict:
    return {"data": str(corpus), "n_layer": 4, "n_head": 2, "d_model": 32, "block_size": 32,
            "batch_size": 4, "steps": 6, "lr": 3e-3, "warmup_steps": 2, "eval_every": 100,
            "eval_batches": 2, "log_every": 2, "dtype": "fp32", "samples": 0, "dropout": 0.1,
            "num_experts": [2, 4], "moe_residual": True, "ep_size": 2}


class Interrupted(Exception):
    """Stands for a run that ended after its checkpoint at step N (a fault, a kill)."""


def _distill(rank: int, cfg_dict: dict, d_dict: dict, run_dir: str, stop_at: int | None):
    from moebit.comm.collectives import init_from_env
    from moebit.distill.run import kd_stage
    from moebit.training.loop import train

    cfg, dcfg = build(cfg_dict), DistillConfig.from_dict(d_dict)
    info = init_from_env("cpu")
    hooks = kd_stage(cfg, dcfg, info).hooks()
    rule = hooks.before_step

    def before_step(loop, step):  # type: ignore[no-untyped-def]
        if step == stop_at:
            raise Interrupted
        rule(loop, step)

    hooks.before_step = before_step
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    try:
        return train(cfg, Path(run_dir), info, hooks)
    except Interrupted:
        return None


def _teacher_then_jobs(rank: int, world: int, t_dict: dict, t_run: str, jobs: list,
                       nan_job: tuple | None):
    """The teacher, then distillations (student cfg, distill cfg, folder, stop_at); the
    ``nan_job`` last, with rank 1's training loss poisoned at its 3rd step."""
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    from toys import poison_gpt_loss

    train(build(t_dict), Path(t_run), init_from_env("cpu"))
    out = [_distill(rank, *job) for job in jobs]
    if nan_job is not None:
        poison_gpt_loss(rank, on_rank=1, at_call=3)
        out.append(_distill(rank, *nan_job))
    return out


def _resume(rank: int, world: int, cfg_dict: dict, d_dict: dict, run_dir: str):
    return _distill(rank, cfg_dict, d_dict, run_dir, None)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("mos-resume")
    teacher = root / "teacher"
    teacher.mkdir()
    t_cfg = build(teacher_cfg(small_corpus))
    (teacher / "config.json").write_text(json.dumps(t_cfg.to_dict()))
    # KD for round(0.25 * 8) = 2 steps: the stage ends before the resume, so the resumed
    # attempt must continue without KD and count the 2 KD steps the first attempt ran.
    d = DistillConfig(teacher=str(teacher), student_layers=2, kd_stop_fraction=0.25,
                      kd_stop_rule="fraction", temperature=2.0)
    cfg, keep = student_train_config(t_cfg, d, {"steps": 2 * N, "save_every": N})
    d.keep_layers = keep
    # --on-nan skip with 1-bit Adam after its freeze and ep 1: rank 1's NaN reaches no other
    # rank's gradients, so only the loop's verdict keeps the ranks in step.
    nan_cfg, _ = student_train_config(t_cfg, d, {"steps": 6, "on_nan": "skip", "ep_size": 1,
                                                 "optimizer": "onebit_adam", "freeze_step": 2,
                                                 "grad_clip": 0.05, "log_every": 1})
    jobs = [(cfg.to_dict(), d.to_dict(), str(root / "straight"), None),
            (cfg.to_dict(), d.to_dict(), str(root / "split"), N)]
    nan_job = (nan_cfg.to_dict(), d.to_dict(), str(root / "nan"), None)
    split = root / "split"  # the run folder `moebit distill` would have written
    split.mkdir()
    (split / "config.json").write_text(json.dumps({**cfg.to_dict(), "run_dir": str(split)}))
    (split / DISTILL_FILE).write_text(json.dumps(d.to_dict()))
    first = run_on_ranks(_teacher_then_jobs, 2, args=(t_cfg.to_dict(), str(teacher), jobs, nan_job),
                         timeout=240)
    cfg.resume = True
    resumed = run_on_ranks(_resume, 2, args=(cfg.to_dict(), d.to_dict(), str(root / "split")),
                           timeout=120)
    return root, first, resumed


def test_resume_is_bit_exact_with_ep2_and_keeps_the_kd_stage(runs):
    root, first, resumed = runs
    assert [r[1] for r in first] == [None, None]  # the split run's first attempt stopped at N
    straight_end, split_end = first[0][0], resumed[0]
    for run in ("straight", "split"):
        assert latest(root / run).name == f"step-{2 * N:08d}"
    for r in range(2):
        a = torch.load(latest(root / "straight") / f"rank-{r:05d}.pt", weights_only=True)["model"]
        b = torch.load(latest(root / "split") / f"rank-{r:05d}.pt", weights_only=True)["model"]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)
    split = _records(root / "split")
    assert [r["kind"] for r in split].count("resume") == 1
    assert [r["step"] for r in split if r["kind"] == "resume"] == [N]
    for recs in (_records(root / "straight"), split):
        stops = [r for r in recs if r["kind"] == "kd_stop"]
        assert [s["step"] for s in stops] == [2], stops
        assert [r["step"] for r in recs if r["kind"] == "train" and "kd_loss" in r] == [2]
        assert [r["step"] for r in recs if r["kind"] == "train"] == [2, 4, 6, 8]
    assert straight_end["kd_steps"] == split_end["kd_steps"] == 2
    (ev,) = [r for r in split if r["kind"] == "eval"]
    assert ev["step"] == 2 * N and ev["val_loss"] == split_end["val_loss"]
    assert ev["val_vs_teacher"] == pytest.approx(ev["val_loss"] / split_end["teacher_val_loss"])
    assert split_end["val_loss"] == straight_end["val_loss"]
    assert split_end["teacher_val_loss"] == straight_end["teacher_val_loss"]


def test_end_record_counts_the_whole_run_across_the_resume(runs):
    """The resumed run's end record reports every attempt's traffic, as the straight run's."""
    root, first, resumed = runs
    straight, split = first[0][0], resumed[0]
    assert straight["bytes_sent"] > 0 and straight["collectives"] > 0
    for key in ("bytes_sent", "bytes_recv", "collectives", "nan_skipped"):
        assert split[key] == straight[key], key
    assert split["train_time"] > 0
    end = _records(root / "split")[-1]
    assert end["kind"] == "end" and end["bytes_sent"] == split["bytes_sent"]


def test_on_nan_skip_freeze_record_and_gradient_metrics(runs):
    root, first, _ = runs
    s0, s1 = first[0][2], first[1][2]
    assert s0["nan_skipped"] == s1["nan_skipped"] == 1
    assert s0["frozen_at"] == s1["frozen_at"] == 2
    recs = _records(root / "nan")
    nans = [r for r in recs if r["kind"] == "nan"]
    assert [(r["step"], r["action"]) for r in nans] == [(3, "skip")]
    (freeze,) = [r for r in recs if r["kind"] == "freeze"]
    assert freeze["step"] == 2 and freeze["clipped_frac_before"] == 1.0
    trains = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [1, 2, 4, 5, 6]  # step 3 was skipped
    assert all(r["grad_norm"] > 0 and 0 <= r["clipped_frac"] <= 1 for r in trains)
    assert recs[-1]["kind"] == "end"
    for r in range(2):
        sd = torch.load(latest(root / "nan") / f"rank-{r:05d}.pt", weights_only=True)["model"]
        assert all(torch.isfinite(t).all() for t in sd.values())


def test_cli_resume_takes_the_run_settings(runs, tmp_path: Path):
    from moebit.cli.args import UsageError
    from moebit.cli.distill import parse_args

    root = runs[0]
    cfg, dcfg, launch = parse_args(["--resume", str(root / "split"), "--nproc", "2",
                                    "--steps", "12"])
    assert cfg.resume and cfg.run_dir == str(root / "split") and cfg.steps == 12
    assert cfg.model_config().n_layer == 2 and launch == {"nproc": 2}
    assert dcfg.to_dict() == json.loads((root / "split" / DISTILL_FILE).read_text())
    assert dcfg.kd_stop_fraction == 0.25 and dcfg.keep_layers == [0, 3]
    with pytest.raises(UsageError, match="drop --teacher"):
        parse_args(["--resume", str(root / "split"), "--teacher", str(root / "teacher")])
    with pytest.raises(UsageError, match="not a distillation run folder"):
        parse_args(["--resume", str(tmp_path)])
    with pytest.raises(UsageError, match="--student-layers is required"):
        parse_args(["--teacher", str(root / "teacher")])
