"""The server's tokenizer interface, and the byte tokenizer of moebit's byte-level models.

A tokenizer for the server is anything with ``encode(text) -> ids``, ``decode(ids) ->
text``, a ``vocab_size`` and optionally ``apply_chat_template(messages) -> text`` (a
Hugging Face tokenizer wrapped in a few lines fits; ``chat_template`` None means the chat
endpoint refuses requests). The byte tokenizer is the default: moebit models see UTF-8
bytes (vocab 256).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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
