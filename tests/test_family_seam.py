"""The model-family seam: a family registered from a test (``toy_family``: its own config,
model class and folder format) plugs into upcycle, train (with resume), distill, generate
and serve without any change to their code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import toy_family

from moebit.checkpoint import latest, read_manifest
from moebit.cli.generate import main as generate_main
from moebit.cli.upcycle import main as upcycle_main
from moebit.distill.run import DistillConfig
from moebit.distill.students import choose_layers
from moebit.distill.teacher import find_teacher, load_teacher, write_student
from moebit.inference.generate import dropless, generate_tokens
from moebit.inference.loading import load_model
from moebit.inference.sampling import SamplingParams
from moebit.models.registry import family_of, family_of_folder
from moebit.serve.engine import Engine, Event, Request
from moebit.testing import run_on_ranks
from moebit.training.config import build

TRAIN = {"block_size": 16, "batch_size": 4, "lr": 3e-3, "warmup_steps": 0, "eval_every": 3,
         "eval_batches": 1, "log_every": 1, "dtype": "fp32", "samples": 1, "save_every": 3}


def _train(rank: int, world: int, values: dict, run_dir: str) -> dict:
    from moebit.comm.collectives import init_from_env
    from moebit.training.loop import train

    return train(build(values), Path(run_dir), init_from_env("cpu"))


def _distill(rank: int, world: int, values: dict, dvalues: dict, run_dir: str) -> dict:
    from moebit.comm.collectives import init_from_env
    from moebit.distill.run import distill

    return distill(build(values), DistillConfig(**dvalues).validate(), Path(run_dir),
                   init_from_env("cpu"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    fam = toy_family.TOY
    model = fam.build(toy_family.ToyConfig(n_layer=4, d_model=32))
    with torch.no_grad():  # non-zero biases, so that copying them is checked too
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return fam.save_folder(model, tmp_path_factory.mktemp("toy") / "dense")


def test_the_registry_routes_configs_manifests_and_folders(dense: Path) -> None:
    assert family_of_folder(dense) is toy_family.TOY
    cfg = toy_family.TOY.read_folder_config(dense)
    assert family_of(cfg) is toy_family.TOY
    assert family_of(build({}).model_config()).name == "gpt"  # the built-ins stay


def test_upcycle_train_resume_distill_generate_serve(dense: Path, small_corpus: Path,
                                                     tmp_path: Path) -> None:
    # upcycle: the CLI's folder path asks the family; identical experts keep the outputs
    up = tmp_path / "up"
    assert upcycle_main([str(dense), "--num-experts", "4", "--num-experts-per-tok", "2",
                         "--moe-every", "2", "--out", str(up)]) == 0
    fam = family_of_folder(up)
    assert fam is toy_family.TOY and fam.pattern(fam.read_folder_config(up)).moe_layers == [1, 3]
    x = torch.randint(0, 256, (2, 16))
    d_model = fam.load_folder(fam.read_folder_config(dense), dense).eval()
    u_model = fam.load_folder(fam.read_folder_config(up), up).eval()
    with torch.no_grad(), dropless(u_model):
        torch.testing.assert_close(u_model(x).logits, d_model(x).logits, atol=1e-5, rtol=0)

    # train --init-from the upcycled folder, then resume it to more steps
    run = tmp_path / "run"
    values = {**TRAIN, "data": str(small_corpus), "init_from": str(up), "steps": 6}
    end = run_on_ranks(_train, 1, args=(values, str(run)), timeout=180)[0]
    assert end["steps"] == 6 and len(end["samples"]) == 1 and end["val_loss"] < 5.5
    start = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["n_expert_params"] > 0
    manifest = read_manifest(latest(run))
    assert manifest["model_config"]["model_type"] == toy_family.TYPE
    end = run_on_ranks(_train, 1, args=({**values, "steps": 9, "resume": True}, str(run)),
                       timeout=180)[0]
    assert end["steps"] == 9
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "resume" and r["step"] == 6 for r in recs)
    trained = load_model(run)
    assert type(trained) is toy_family.ToyLM

    # distill: the run is the teacher; the student keeps 2 of its 4 layers (dense, MoE)
    t = find_teacher(run)
    assert t.family is toy_family.TOY and t.folder == up and t.step == 9
    keep = choose_layers(t.config, 2)
    assert keep == [0, 3]
    student_dir = tmp_path / "student-init"
    write_student(load_teacher(t), keep, student_dir)
    s_values = {**TRAIN, "data": str(small_corpus), "init_from": str(student_dir), "steps": 4,
                "samples": 0}
    d_end = run_on_ranks(_distill, 1, timeout=180, args=(
        s_values, {"teacher": str(run), "student_layers": 2, "keep_layers": keep,
                   "kd_stop_rule": "fraction", "kd_stop_fraction": 1.0},
        str(tmp_path / "distilled")))[0]
    assert d_end["kd_steps"] == 4 and d_end["teacher_val_loss"] > 0

    # generate: the CLI reads the folder through the family, greedy as generate_tokens
    out = tmp_path / "gen.json"
    threads = torch.get_num_threads()
    try:
        rc = generate_main([str(up), "--prompt", "def ", "--max-new-tokens", "5",
                            "--temperature", "0", "--threads", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    want = generate_tokens(u_model, [list(b"def ")], max_new_tokens=5, temperature=0).tokens[0]
    assert json.loads(out.read_text())["texts"] == [bytes(want).decode("utf-8", errors="replace")]

    # serve: the engine decodes the family's model with its tokenizer
    tok = fam.tokenizer(None)
    eng = Engine(trained, tok, max_batch=2, max_queue=4)
    events: list[Event] = []
    eng.submit(Request("a", tok.encode("def "), SamplingParams(max_tokens=5, temperature=0),
                       events.append))
    while eng.busy():
        eng.step()
    ref = generate_tokens(trained, [tok.encode("def ")], max_new_tokens=5, temperature=0).tokens[0]
    assert "".join(e.text for e in events) == tok.decode(ref)
    assert events[-1].finish_reason == "length"
