"""Chat templates render exactly as transformers' ``apply_chat_template`` renders them, for
each supported family's template, read from ``chat_template.jinja`` (what transformers 5
writes) or from ``tokenizer_config.json`` (older folders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_templates import FAMILIES

from moebit.models.tokenizer import ChatTemplateError, HFTokenizer

transformers = pytest.importorskip("transformers", reason="the reference renderer: pip install 'moebit[hf]'")

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief & <polite>."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "tool", "content": "c"}, {"role": "user", "content": "\u00e9\u4e2d \"q\""}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
]


def _folder(root: Path, name: str, template: str, jinja_file: bool) -> Path:
    """A tiny tokenizer saved by transformers, with ``template`` in the file of each format."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world chat template test"] * 4, trainers.BpeTrainer(
        vocab_size=60, special_tokens=list(SPECIAL.values()), show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.chat_template = template
    d = root / f"{name}-{'jinja' if jinja_file else 'config'}"
    fast.save_pretrained(d)
    if not jinja_file:  # the older layout: the template inside tokenizer_config.json
        (d / "chat_template.jinja").unlink(missing_ok=True)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return d


@pytest.mark.parametrize("jinja_file", [True, False], ids=["chat_template.jinja", "tokenizer_config"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_render_equals_transformers(tmp_path: Path, family: str, jinja_file: bool) -> None:
    d = _folder(tmp_path, family, FAMILIES[family], jinja_file)
    assert (d / "chat_template.jinja").is_file() == jinja_file
    ours = HFTokenizer.from_folder(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    assert ours.chat_template == FAMILIES[family]
    rendered = 0
    for chat in CHATS:
        try:
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template refuses this chat: so must we
            with pytest.raises(ChatTemplateError, match=str(e).split("!")[0][:40]):
                ours.apply_chat_template(chat)
            continue
        assert ours.apply_chat_template(chat) == want, (family, chat)
        rendered += 1
    assert rendered >= 2


def test_template_errors_are_chat_template_errors(tmp_path: Path) -> None:
    d = _folder(tmp_path, "broken", "{% for m in messages %}{{ m.content", jinja_file=True)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        HFTokenizer.from_folder(d).apply_chat_template(CHATS[0])
    d = _folder(tmp_path, "mixtral", FAMILIES["mixtral"], jinja_file=True)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        HFTokenizer.from_folder(d).apply_chat_template(CHATS[1])
