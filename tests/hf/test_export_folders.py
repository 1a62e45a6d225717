"""`moebit export` into existing folders, and the tokenizer files (chat template included)
that export, upcycle and the distillation student carry: transformers' AutoTokenizer is the
oracle."""

from __future__ import annotations

import pytest
import torch
from folder_helpers import CHAT_TEMPLATE, hf_folder, hf_run
from hf_models import BASE

from moebit.cli import main as moebit
from moebit.cli.export import export

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hf") / "mixtral")


def _logits(folder):
    m = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return m(IDS).logits


def _same_tokenizer(folder, src):
    got = transformers.AutoTokenizer.from_pretrained(folder)
    want = transformers.AutoTokenizer.from_pretrained(src)
    assert got.chat_template == want.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "def f(x):"}]
    assert (got.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == want.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert got("return x + 1")["input_ids"] == want("return x + 1")["input_ids"]


def test_export_refuses_a_non_empty_folder_and_overwrite_replaces_the_model(src, tmp_path, capsys):
    run = tmp_path / "run"
    model = hf_run(src, run)
    out = tmp_path / "out"
    out.mkdir()
    # an older single-file model there: transformers would load it before the new shards
    transformers.AutoModelForCausalLM.from_pretrained(src).save_pretrained(out)
    (out / "README.md").write_text("my notes\n")
    stale = _logits(out)
    capsys.readouterr()  # transformers' progress bars
    assert moebit(["export", str(run), "--to", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "model.safetensors").is_file()  # refused: nothing touched
    assert moebit(["export", str(run), "--to", str(out), "--overwrite"]) == 0
    assert not (out / "model.safetensors").exists()  # the stale single file went
    assert (out / "README.md").read_text() == "my notes\n"  # not a model file: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no temp folder left
    with torch.no_grad():
        torch.testing.assert_close(_logits(out), model(IDS).logits, atol=1e-4, rtol=0)
    assert (_logits(out) - stale).abs().max() > 1e-3
    _same_tokenizer(out, src)


def test_export_refuses_a_run_folder_and_a_file(src, tmp_path):
    run = tmp_path / "run"
    hf_run(src, run)
    with pytest.raises(ValueError, match="moebit run folder"):
        export(run, run, overwrite=True)
    with pytest.raises(ValueError, match="moebit run folder"):
        export(run, run / "checkpoints" / "x", overwrite=True)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        export(run, tmp_path / "f")
    assert (run / "config.json").is_file() and list((run / "checkpoints").iterdir())


def test_export_into_a_new_or_empty_folder(src, tmp_path):
    run = tmp_path / "run"
    model = hf_run(src, run)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        export(run, out)
        with torch.no_grad():
            torch.testing.assert_close(_logits(out), model(IDS).logits, atol=1e-4, rtol=0)
        _same_tokenizer(out, src)


def test_upcycle_carries_the_chat_template(tmp_path):
    from folder_helpers import add_tokenizer

    dense = tmp_path / "llama"
    cfg = transformers.AutoConfig.for_model("llama", **{**BASE, "vocab_size": 320})
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(dense)
    add_tokenizer(dense)
    out = tmp_path / "up"
    assert moebit(["upcycle", str(dense), "--num-experts", "4", "--out", str(out)]) == 0
    assert (out / "chat_template.jinja").is_file()
    _same_tokenizer(out, dense)


def test_distill_student_folder_carries_the_chat_template(src, tmp_path):
    from moebit.cli.distill import parse_args

    run = tmp_path / "mos"
    cfg, _, _ = parse_args(["--teacher", str(src), "--student-layers", "2", "--block-size", "16",
                           "--run-dir", str(run)])
    student = run / "student-init"
    assert cfg.init_from == str(student)
    assert (student / "chat_template.jinja").is_file()
    _same_tokenizer(student, src)
