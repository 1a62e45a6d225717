"""Corrupt Hugging Face folders: each problem is one line naming the file, exit code 2, for
generate, serve, train --init-from and distill --teacher, before any rank starts (train and
distill leave no run folder)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from folder_helpers import hf_folder
from hf_models import make_hf_model

from moebit.cli import main as moebit
from moebit.models.hf.folder import check_folder

pytest.importorskip("transformers")


def _truncate(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(d):
    (d / "model.safetensors").write_bytes(b"\x00not a safetensors file" * 64)


def _drop_tensor(d):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def _bad_shape(d):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(5)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


# name -> (how to break a folder, what the one line says: the file and the problem)
BREAKS = {
    "truncated": (_truncate, "model.safetensors: not a readable safetensors file"),
    "garbage": (_garbage, "model.safetensors: not a readable safetensors file"),
    "missing_tensor": (_drop_tensor, "model.safetensors: no tensor "
                                     "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
    "bad_shape": (_bad_shape, "tensor model.norm.weight has shape (5,), config.json implies (32,)"),
    "bad_tokenizer": (lambda d: (d / "tokenizer.json").write_text("{not json"),
                      "tokenizer.json: not a valid tokenizer"),
    "bad_config": (lambda d: (d / "config.json").write_text("{\"model_type\": "),
                   "config.json is not valid JSON"),
    "config_key": (lambda d: (d / "config.json").write_text('{"model_type": "mixtral"}'),
                   "config.json: mixtral config.json has no"),
    "bad_tokenizer_config": (lambda d: (d / "tokenizer_config.json").write_text("[1,"),
                             "tokenizer_config.json is not valid JSON"),
    "no_tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json does not exist"),
}
# training falls back to byte ids without a tokenizer (this vocabulary has 320 ids)
TRAINS_WITHOUT_TOKENIZER = ("no_tokenizer",)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("good") / "mixtral")


@pytest.fixture(params=sorted(BREAKS))
def broken(request, good, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(good, d)
    how, said = BREAKS[request.param]
    how(d)
    return request.param, d, said


def _one_line(capsys, said: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert said in err, err
    return err


def test_the_good_folder_passes_every_check(good):
    assert check_folder(good, tokenizer="required").model_type == "mixtral"


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_generate_and_serve_name_the_file(cmd, broken, capsys):
    _, d, said = broken
    argv = [cmd, str(d), "--prompt", "def "] if cmd == "generate" else [cmd, str(d), "--port", "1"]
    capsys.readouterr()
    assert moebit(argv) == 2
    _one_line(capsys, said)


@pytest.mark.parametrize("cmd", ["train", "distill"])
def test_train_and_distill_check_before_any_rank_and_leave_no_run(cmd, broken, tmp_path, capsys):
    name, d, said = broken
    if name in TRAINS_WITHOUT_TOKENIZER:
        pytest.skip("training falls back to byte ids (vocabulary >= 256): not an error")
    run = tmp_path / "run"
    argv = (["train", "--init-from", str(d)] if cmd == "train" else
            ["distill", "--teacher", str(d), "--student-layers", "2"])
    capsys.readouterr()
    assert moebit([*argv, "--block-size", "16", "--steps", "1", "--nproc", "1",
                   "--run-dir", str(run)]) == 2
    _one_line(capsys, said)
    assert not run.exists()


@pytest.mark.parametrize("cmd", ["train", "distill"])
def test_training_without_tokenizer_needs_a_byte_sized_vocabulary(cmd, tmp_path, capsys):
    make_hf_model("mixtral", tmp_path / "small")  # vocabulary 96, no tokenizer.json
    run = tmp_path / "run"
    argv = (["train", "--init-from"] if cmd == "train" else
            ["distill", "--student-layers", "2", "--teacher"])
    capsys.readouterr()
    assert moebit([*argv, str(tmp_path / "small"), "--block-size", "16",
                   "--nproc", "1", "--run-dir", str(run)]) == 2
    _one_line(capsys, "tokenizer.json does not exist and the vocabulary (96) is too small")
    assert not run.exists()


def test_the_command_line_prints_one_line_and_exits_2(good, tmp_path):
    """The real process: no traceback reaches the terminal."""
    d = tmp_path / "broken"
    shutil.copytree(good, d)
    _drop_tensor(d)
    r = subprocess.run([sys.executable, "-m", "moebit.cli", "generate", str(d), "--prompt", "x"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"moebit generate: error: {d / 'model.safetensors'}: no tensor "
        "model.layers.1.block_sparse_moe.experts.2.w3.weight"]
