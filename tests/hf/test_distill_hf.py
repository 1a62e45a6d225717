"""Mixture-of-Students for the Hugging Face families: which layers the student keeps, its
config.json, its initial weights (transformers as the oracle), and `moebit distill` on 2
gloo ranks with ep 2, resume and export."""

from __future__ import annotations

import copy
import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from hf_models import make_hf_model, run_moebit, text_corpus, train_tokenizer

from moebit.cli.serve import load_for_serving
from moebit.distill.students import DistillError, check_keep, choose_layers
from moebit.distill.teacher import find_teacher, load_teacher, write_student
from moebit.hf import HFDecoderConfig, from_pretrained, read_config
from moebit.inference.loading import load_model
from moebit.models.hf.family import student_hf_dict
from moebit.models.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))


def read_config_of(hf: dict):
    return HFDecoderConfig.from_hf(hf)


def _config(family: str, tmp: Path, **overrides):
    make_hf_model(family, tmp / family, **overrides)
    return read_config(tmp / family)


def test_layers_follow_depth_and_the_family_pattern(tmp_path):
    mixtral = _config("mixtral", tmp_path, num_hidden_layers=5)
    assert choose_layers(mixtral, 2) == [0, 4]  # the first and the last layer stay
    assert choose_layers(mixtral, 3) == [0, 2, 4]
    # Qwen3-MoE, decoder_sparse_step 2: MoE at 1, 3, 5; a 4-layer student is dense, MoE, dense, MoE
    qwen3 = _config("qwen3_moe", tmp_path, num_hidden_layers=6)
    assert qwen3.moe_layers == [1, 3, 5]
    keep = choose_layers(qwen3, 4)
    assert keep == [0, 1, 4, 5]
    hf = student_hf_dict(qwen3, keep)
    assert hf["num_hidden_layers"] == 4 and hf["decoder_sparse_step"] == 2
    assert hf["mlp_only_layers"] == []
    with pytest.raises(DistillError, match="student layer 0 is dense by the family's pattern"):
        check_keep(qwen3, [1, 2, 4, 5])
    # Qwen2-MoE, mlp_only_layers [2]: a dense teacher layer may fill an MoE slot, listed
    # again in the student's mlp_only_layers; layer_types follow their layers
    qwen2 = _config("qwen2_moe", tmp_path, num_hidden_layers=5, mlp_only_layers=[2])
    assert qwen2.moe_layers == [0, 1, 3, 4]
    keep = choose_layers(qwen2, 3)
    assert keep == [0, 2, 4]
    hf = student_hf_dict(qwen2, keep)
    assert hf["mlp_only_layers"] == [1] and len(hf["layer_types"]) == 3
    assert read_config_of(hf).moe_layers == [0, 2]
    assert student_hf_dict(qwen2, [0, 4])["mlp_only_layers"] == []


def test_named_errors(tmp_path):
    cfg = _config("olmoe", tmp_path)
    with pytest.raises(DistillError, match="shallower than the teacher"):
        choose_layers(cfg, 3)
    with pytest.raises(DistillError, match="strictly increasing"):
        check_keep(cfg, [1, 0])
    with pytest.raises(DistillError, match="does not exist"):
        find_teacher(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "mixtral"}')
    with pytest.raises(DistillError, match="neither safetensors"):
        find_teacher(tmp_path / "empty")


def _truncated(model, keep: list[int]):
    """transformers' own student: the teacher with only the ``keep`` decoder layers."""
    s = copy.deepcopy(model)
    s.model.layers = torch.nn.ModuleList(s.model.layers[k] for k in keep)
    s.config.num_hidden_layers = len(keep)
    return s


@pytest.mark.parametrize("n_student", [2, 3])
def test_student_init_is_the_chosen_teacher_layers(family, n_student, tmp_path):
    teacher_hf = make_hf_model(family, tmp_path / "t", num_hidden_layers=4)
    t = find_teacher(tmp_path / "t")
    keep = choose_layers(t.config, n_student)
    write_student(load_teacher(t), keep, tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == n_student
    student_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s").eval()
    t_sd, s_sd = teacher_hf.state_dict(), student_hf.state_dict()
    for name, tensor in s_sd.items():
        src = name
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            src = f"model.layers.{keep[int(i)]}.{rest}"
        torch.testing.assert_close(tensor, t_sd[src], atol=0, rtol=0, msg=name)
    with torch.no_grad():
        want = _truncated(teacher_hf, keep)(IDS, use_cache=False).logits
        torch.testing.assert_close(student_hf(IDS).logits, want, atol=1e-5, rtol=0)
        moebit_logits = from_pretrained(tmp_path / "s")(IDS).logits
        torch.testing.assert_close(moebit_logits, want, atol=1e-4, rtol=0)


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


SMALL = ["--block-size", "16", "--batch-size", "2", "--threads", "1", "--eval-every", "2",
         "--eval-batches", "1", "--dtype", "fp32", "--warmup-steps", "1", "--log-every", "1"]


@pytest.mark.slow
def test_distill_ep2_resume_export(tmp_path):
    """2 gloo ranks, ep 2: KD on the teacher's tokenizer ids, resume, then export."""
    src = tmp_path / "hf"
    make_hf_model("qwen3_moe", src, vocab_size=320, num_hidden_layers=4)  # MoE at 1, 3
    train_tokenizer(src)
    run = tmp_path / "run"
    r = run_moebit(["distill", "--teacher", str(src), "--student-layers", "2",
                 "--data", str(text_corpus(tmp_path, 30000)), *SMALL, "--steps", "2", "--teacher-dtype",
                 "fp32", "--kd-stop", "fraction", "--kd-stop-fraction", "1.0", "--nproc", "2",
                 "--ep-size", "2", "--save-every", "2", "--run-dir", str(run)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "distill.json").read_text())["keep_layers"] == [0, 3]
    student = json.loads((run / "student-init" / "config.json").read_text())
    assert student["num_hidden_layers"] == 2 and (run / "student-init" / "tokenizer.json").is_file()
    manifest = json.loads(next(run.glob("checkpoints/*/manifest.json")).read_text())
    assert manifest["ep_size"] == 2 and manifest["model_config"]["num_layers"] == 2
    assert manifest["model_config"]["hf"]["num_hidden_layers"] == 2
    r = run_moebit(["distill", "--resume", str(run), "--steps", "4", "--nproc", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _records(run)
    start = next(x for x in recs if x["kind"] == "start")
    assert start["teacher_layers"] == 4 and start["keep_layers"] == [0, 3]
    assert start["teacher_val_loss"] > 0 and start["init_val_loss"] > 0
    kd = [x["kd_loss"] for x in recs if x["kind"] == "train"]
    assert len(kd) == 4 and all(v > 0 for v in kd)
    assert [x for x in recs if x["kind"] == "end"][-1]["kd_steps"] == 4
    r = run_moebit(["export", str(run), "--to", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.num_hidden_layers == 2
    model = load_model(run)
    init = from_pretrained(run / "student-init")
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
        assert (init(ids).logits - model(ids).logits).abs().max() > 1e-3  # it did train


@pytest.mark.slow
def test_teacher_is_a_run_trained_init_from(tmp_path):
    """A run fine-tuned --init-from a folder teaches: its checkpoint's layers start the
    student, its training settings are the student's, its folder's tokenizer is used."""
    src = tmp_path / "hf"
    make_hf_model("mixtral", src, vocab_size=320, num_hidden_layers=3)
    train_tokenizer(src)
    teacher_run = tmp_path / "teacher"
    r = run_moebit(["train", "--init-from", str(src), "--data", str(text_corpus(tmp_path, 30000)), *SMALL,
                 "--steps", "2", "--nproc", "1", "--samples", "0", "--run-dir", str(teacher_run)],
                tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # serving the fine-tuned run reads and writes its folder's token ids, as generate does
    _, tok = load_for_serving(Namespace(checkpoint=str(teacher_run), ep_size=None, context=None), 0)
    assert tok.encode("def wrap(text") == HFTokenizer.from_folder(src).encode("def wrap(text")
    assert tok.encode("def wrap(text") != list(b"def wrap(text")
    run = tmp_path / "run"
    r = run_moebit(["distill", "--teacher", str(teacher_run), "--student-layers", "2", "--steps", "2",
                 "--nproc", "1", "--lr", "1e-4", "--run-dir", str(run)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["block_size"] == 16 and cfg["data"] == str(text_corpus(tmp_path, 30000)) and cfg["lr"] == 1e-4
    start = next(x for x in _records(run) if x["kind"] == "start")
    assert start["teacher_step"] == 2 and start["keep_layers"] == [0, 2]
    assert (run / "student-init" / "tokenizer.json").is_file()
    teacher, init = load_model(teacher_run), from_pretrained(run / "student-init")
    t_sd = teacher.state_dict()
    for name, tensor in init.state_dict().items():
        src_name = name.replace("blocks.1.", "blocks.2.")
        torch.testing.assert_close(tensor, t_sd[src_name], atol=0, rtol=0, msg=name)


def test_cli_refuses_bad_requests(tmp_path):
    from moebit.cli.args import UsageError
    from moebit.cli.distill import parse_args

    make_hf_model("mixtral", tmp_path / "t", num_hidden_layers=3)
    with pytest.raises(DistillError, match="shallower than the teacher"):
        parse_args(["--teacher", str(tmp_path / "t"), "--student-layers", "3"])
    with pytest.raises(DistillError, match="does not exist"):
        parse_args(["--teacher", str(tmp_path / "missing"), "--student-layers", "2"])
    with pytest.raises(UsageError, match="--n-layer cannot be set"):
        parse_args(["--teacher", str(tmp_path / "t"), "--student-layers", "2", "--n-layer", "2"])
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("")
    with pytest.raises(UsageError, match="already holds a run"):
        parse_args(["--teacher", str(tmp_path / "t"), "--student-layers", "2",
                    "--run-dir", str(tmp_path / "used")])
    assert not (tmp_path / "used" / "student-init").exists()
