"""`moebit train --outer ...`: one-line errors before any rank starts, two launchers of one
node each training as two DiLoCo workers, and the bench's DiLoCo rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moebit.cli import main as cli_main
from moebit.testing import free_port

from launches import restart_after_a_kill, restart_args, run_two_nodes, start

BASE = ["--nproc", "2", "--n-layer", "2", "--n-head", "2", "--d-model", "32",
        "--block-size", "32", "--batch-size", "2", "--steps", "4"]

BAD = [
    (["--outer", "diloco"], "outer_every: outer=diloco needs outer_every >= 1"),
    (["--outer", "diloco", "--outer-every", "0"], "outer_every: outer=diloco needs outer_every >= 1"),
    (["--outer", "ring"], "outer: must be one of none, diloco, streaming_diloco"),
    (["--outer", "diloco", "--outer-every", "4", "--outer-fragments", "2"],
     "outer_fragments: outer=diloco syncs the whole model at once"),
    (["--outer", "streaming_diloco", "--outer-every", "40", "--outer-fragments", "5"],
     "outer_fragments: 5 fragments, but the model has 4 blocks"),
    (["--outer", "streaming_diloco", "--outer-every", "4", "--outer-fragments", "2",
      "--outer-delay", "2"], "invalid outer_delay 2: must be below outer_every/outer_fragments"),
    (["--outer", "diloco", "--outer-every", "4", "--outer-compress", "fp8"],
     "invalid outer_compress 'fp8'"),
    (["--outer", "diloco", "--outer-every", "4", "--outer-momentum", "1"],
     "invalid outer_momentum 1.0: must be below 1"),
    (["--outer", "diloco", "--outer-every", "4", "--outer-group", "rack"],
     "outer_group: must be one of node, world"),
    (["--outer", "diloco", "--outer-every", "4", "--outer-group", "world", "--num-experts", "4",
      "--ep-size", "2"], "outer_group: outer_group='world' with ep_size=2"),
    (["--outer", "diloco", "--outer-every", "4", "--num-experts", "4", "--ep-size", "2",
      "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"],
     "outer_group: ep_size=2 must divide LOCAL_WORLD_SIZE=1"),
]


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_outer_settings_are_one_line_errors(flags, message, tmp_path: Path, capsys):
    run = tmp_path / "run"
    assert cli_main(["train", *BASE, "--run-dir", str(run), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moebit train: error: "), err
    assert message in err[0], err[0]
    assert not run.exists(), "nothing is written before the checks pass"


def test_an_optimizer_that_cannot_be_wrapped_is_refused(tmp_path: Path, capsys):
    from moebit.optim import build as optim_build
    from moebit.optim import register_optimizer

    class NotAnOptimizer:
        def __init__(self, groups, lr):
            self.param_groups = list(groups)

    register_optimizer("not_an_optimizer", lambda groups, s, **extra: NotAnOptimizer(groups, s.lr))
    try:
        assert cli_main(["train", *BASE, "--run-dir", str(tmp_path / "r"), "--optimizer",
                         "not_an_optimizer", "--outer", "diloco", "--outer-every", "4"]) == 2
    finally:
        optim_build._REGISTRY.pop("not_an_optimizer")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "outer (diloco around optimizer=not_an_optimizer)" in err[0], err
    assert "must be a torch.optim.Optimizer" in err[0]


def test_bench_rows_wrap_adam_and_only_they_take_the_outer_flags():
    from moebit.bench.train import _jobs, parse

    args, extra = parse(["--optimizers", "adam,diloco,streaming_diloco", "--nproc", "2",
                         "--steps", "20", "--", "--outer-every", "10", "--outer-compress",
                         "1bit", "--no-outer-nesterov", "--batch-size", "2"])
    jobs = {label: argv for label, argv, _ in _jobs(args, extra, Path("out"))}
    assert list(jobs) == ["adam", "diloco", "streaming_diloco"]
    adam = jobs["adam"]
    assert not [a for a in adam if "outer" in a] and adam[-2:] == ["--batch-size", "2"]
    for row in ("diloco", "streaming_diloco"):
        argv = jobs[row]
        assert argv[argv.index("--optimizer") + 1] == "adam"
        assert argv[argv.index("--outer") + 1] == row
        assert argv[argv.index("--outer-every") + 1] == "10"
        assert argv[argv.index("--outer-compress") + 1] == "1bit"
        assert argv[argv.index("--outer-group") + 1] == "world"  # one machine: rank = worker
        assert "--no-outer-nesterov" in argv


@pytest.mark.slow
@pytest.mark.timeout(900)  # two launchers on a loaded machine: torchrun's start is slow
def test_two_launchers_train_as_two_diloco_workers(tmp_path: Path, small_corpus: Path):
    """--nnodes 2 --outer-group node: each launcher's node is one worker (one rank here);
    they meet only at the syncs, and end on one agreed model."""
    port = free_port()
    run_dir = tmp_path / "run"
    common = ["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"outer{port}", "--data", str(small_corpus), "--n-layer", "1",
              "--n-head", "2", "--d-model", "32", "--block-size", "32", "--batch-size", "4",
              "--steps", "8", "--eval-every", "8", "--eval-batches", "1", "--samples", "0",
              "--dtype", "fp32", "--log-every", "2", "--threads", "1", "--outer", "diloco",
              "--outer-every", "4", "--outer-group", "node", "--outer-compress", "int8"]
    run_two_nodes(common, run_dir, port, timeout=400, bind_wait=120)
    recs = [json.loads(x) for x in (run_dir / "node0" / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["world_size"] == 2
    assert [r["step"] for r in recs if r["kind"] == "outer"] == [4, 8]
    end = recs[-1]
    assert end["kind"] == "end" and end["outer_syncs"] == 2
    assert end["bytes_sent_by_kind"]["outer"] > 0
    # Each node's rank writes its shard into its own run folder; both hold the same model.
    shards = [torch.load(run_dir / f"node{i}" / "checkpoints" / "step-00000008" /
                         f"rank-{i:05d}.pt", weights_only=True) for i in range(2)]
    assert shards[0]["outer"]["topology"]["outer_ranks"] == [0, 1]
    for k, v in shards[0]["model"].items():
        assert torch.equal(v, shards[1]["model"][k]), k


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_max_restarts_resumes_a_diloco_run(tmp_path: Path, small_corpus: Path):
    """A rank killed after the first checkpoint (step 10, mid-interval of H=4): torchrun
    restarts the ranks, they restore the outer state and the run finishes."""
    run = tmp_path / "run"
    args = [*restart_args(small_corpus, run, 200, 10), "--outer", "diloco", "--outer-every", "4",
            "--outer-group", "world", "--outer-compress", "1bit"]
    recs = restart_after_a_kill(start("train", args, run), timeout=400, wait=300)
    resumes = [r for r in recs if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] % 10 == 0
    syncs = [r["step"] for r in recs if r["kind"] == "outer"]
    assert syncs == list(range(4, 201, 4)), "every sync once, on the schedule"
    assert recs[-1]["kind"] == "end" and recs[-1]["outer_syncs"] == 50
