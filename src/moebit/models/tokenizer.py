"""The server's tokenizer interface, the byte tokenizer, and Hugging Face chat templates.

A tokenizer for the server is anything with ``encode(text) -> ids``, ``decode(ids) ->
text``, a ``vocab_size`` and optionally ``apply_chat_template(messages) -> text`` (a
Hugging Face tokenizer wrapped in a few lines fits; ``chat_template`` None means the chat
endpoint refuses requests), ``bos_id`` (what an empty prompt starts from) and
``max_token_bytes`` (the longest token's text: a prompt of more than ``context *
max_token_bytes`` bytes cannot fit, and is refused before it is tokenized). The byte
tokenizer is the default: moebit models see UTF-8 bytes (vocab 256).

Chat templates render as transformers' ``apply_chat_template`` does: a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension,
``raise_exception``, ``strftime_now`` and a ``tojson`` that does not escape HTML, the
tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) as variables, and
``add_generation_prompt=True``. A folder's template is ``chat_template.jinja`` (what
transformers 5 writes) or else ``tokenizer_config.json``'s ``chat_template``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from moebit.models.hf.tokens import load_tokenizer

NEWLINE = 10  # an empty prompt starts from a newline byte, as in moebit generate
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# the named special tokens transformers hands every chat template (special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ChatTemplateError(ValueError):
    """The chat template failed on these messages (``raise_exception``, a Jinja error)."""


def simple_chat_template(messages: list[dict[str, Any]]) -> str:
    """``role: content`` lines, then ``assistant:``: a plain template for byte models."""
    lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


@dataclass
class ByteTokenizer:
    vocab_size: int = 256
    chat_template: Callable[[list[dict[str, Any]]], str] | None = simple_chat_template
    bos_id: int | None = None  # an empty text is already a newline byte
    max_token_bytes: int = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) or [NEWLINE]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        return self.chat_template(messages)


def _jinja() -> Any:
    """jinja2 (torch's own dependency), imported on the first chat template: every training
    rank imports this module, and only a server or a chat prompt renders a template."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    return jinja2


def _raise_exception(message: str) -> None:
    raise _jinja().exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> Any:
    """A jinja2 Template compiled in transformers' environment (cached: compiling is the
    slow part)."""
    jinja2 = _jinja()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def render_chat(source: str, messages: list[dict[str, Any]], special: dict[str, str] | None = None,
                add_generation_prompt: bool = True) -> str:
    """``messages`` through the Jinja template ``source``, as transformers renders it; any
    failure of the template is a ChatTemplateError (a 400 for the server)."""
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    template = compile_chat_template(source)
    jinja2 = _jinja()
    try:
        return template.render(messages=plain, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **(special or {}))
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError,
            IndexError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_json(f: Path) -> dict[str, Any]:
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def read_chat_template(folder: str | Path) -> str | None:
    """The folder's chat template: ``chat_template.jinja`` (transformers 5), else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates
    whose "default" is taken); None when it has none."""
    jinja_file = Path(folder) / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    t = _read_json(Path(folder) / "tokenizer_config.json").get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    return t if isinstance(t, str) else None


@dataclass
class HFTokenizer:
    """A Hugging Face folder's ``tokenizer.json`` (through the ``tokenizers`` library), with
    the folder's Jinja chat template when it has one."""

    tokenizer: Any
    chat_template: str | None = None
    special: dict[str, str] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    @property
    def bos_id(self) -> int | None:
        """The BOS token's id (an empty prompt starts from it), None when there is none."""
        bos = (self.special or {}).get("bos_token")
        return None if bos is None else self.tokenizer.token_to_id(bos)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound of the UTF-8 bytes one token stands for: the longest vocabulary
        entry's own UTF-8 length (a byte-level entry like "Ġhello" is longer than its text)."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8")) for t in vocab), default=1)

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        meta = {**_read_json(Path(folder) / "special_tokens_map.json"),
                **_read_json(Path(folder) / "tokenizer_config.json")}
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(meta.get(k))) is not None}
        return cls(load_tokenizer(folder), read_chat_template(folder), special)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template "
                                    f"({CHAT_TEMPLATE_FILE} or tokenizer_config.json)")
        return render_chat(self.chat_template, messages, self.special)
