"""The server's tokenizer interface, and the byte tokenizer of moebit's byte-level models.

A tokenizer for the server is anything with ``encode(text) -> ids``, ``decode(ids) ->
text``, a ``vocab_size`` and optionally ``apply_chat_template(messages) -> text`` (a
Hugging Face tokenizer wrapped in a few lines fits; ``chat_template`` None means the chat
endpoint refuses requests). The byte tokenizer is the default: moebit models see UTF-8
bytes (vocab 256).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jinja2  # torch's own dependency: renders Hugging Face chat templates

from moebit.models.hf.tokens import load_tokenizer

NEWLINE = 10  # an empty prompt starts from a newline byte, as in moebit generate


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def simple_chat_template(messages: list[dict[str, str]]) -> str:
    """``role: content`` lines, then ``assistant:``: a plain template for byte models."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


@dataclass
class ByteTokenizer:
    vocab_size: int = 256
    chat_template: Callable[[list[dict[str, str]]], str] | None = simple_chat_template

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) or [NEWLINE]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self.chat_template(messages)


@dataclass
class HFTokenizer:
    """A Hugging Face folder's ``tokenizer.json`` (through the ``tokenizers`` library), with
    the folder's Jinja chat template (``tokenizer_config.json``) when it has one."""

    tokenizer: Any
    chat_template: str | None = None
    special: dict[str, str] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        cfg_file = Path(folder) / "tokenizer_config.json"
        meta = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        special = {k: v if isinstance(v, str) else (v or {}).get("content", "")
                   for k, v in meta.items() if k in ("bos_token", "eos_token")}
        template = meta.get("chat_template")
        return cls(load_tokenizer(folder), template if isinstance(template, str) else None, special)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template (tokenizer_config.json)")
        return jinja2.Template(self.chat_template).render(
            messages=messages, add_generation_prompt=True, **(self.special or {}))
