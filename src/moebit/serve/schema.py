"""Request bodies of the OpenAI API: parsing, validation, and what the server refuses.

A body is read as JSON whatever its content-type (``curl -d`` sends
``application/x-www-form-urlencoded``), validated by these pydantic models, and turned
into ``SamplingParams``. Every failure is a ``BadRequest`` naming the field (``param``),
reported as OpenAI's 400 ``invalid_request_error``.

Fields OpenAI defines that this server does not implement are refused by name when set
to anything but their no-op value (``logprobs``, ``top_logprobs``, penalties, ...), never
ignored: a client asking for them would otherwise read a reply that silently lacks them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moebit.inference.sampling import SamplingParams


class BadRequest(ValueError):
    """A 400: ``message``, the field it is about (``param``), an OpenAI error ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def _finite(default: float, **bounds: float) -> Any:
    return Field(default, allow_inf_nan=False, **bounds)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins
    temperature: float = _finite(1.0, ge=0, le=100)
    top_p: float = _finite(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1)
    # refused unless left at their no-op value (see UNSUPPORTED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None


class CompletionBody(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the template's
    role: str
    content: str | list[dict[str, Any]] | None = None

    def plain(self) -> dict[str, Any]:
        """The message for a chat template: text parts joined by newlines (as vLLM does for
        a string-content template); another part type is a BadRequest."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                try:
                    texts.append(TextPart.model_validate(part).text)
                except ValidationError:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise BadRequest(f"messages: a content part of type {kind!r} is not "
                                     "supported (only {\"type\": \"text\", \"text\": ...})",
                                     "messages") from None
            d["content"] = "\n".join(texts)
        return d


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None


# field -> (the value that asks for nothing, what to tell a client that sets it)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "logprobs": ((None, False), "logprobs are not supported by this server"),
    "top_logprobs": ((None, 0), "top_logprobs (logprobs) are not supported by this server"),
    "presence_penalty": ((None, 0, 0.0), "presence_penalty is not supported (leave it 0)"),
    "frequency_penalty": ((None, 0, 0.0), "frequency_penalty is not supported (leave it 0)"),
    "logit_bias": ((None,), "logit_bias is not supported by this server"),
    "best_of": ((None, 1), "best_of is not supported (leave it 1)"),
    "suffix": ((None, ""), "suffix (insertion) is not supported by this server"),
    "tools": ((None,), "tools (function calling) are not supported by this server"),
}


def parse_body(raw: bytes, cls: type[_Sampling]) -> _Sampling:
    """The body as ``cls``, or a BadRequest naming what is wrong (any content-type)."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}", code=None) from None
    if not isinstance(obj, dict):
        raise BadRequest("the body must be a JSON object", code=None)
    try:
        body = cls.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
        param = loc[0] if loc else None
        raise BadRequest(f"{param or 'body'}: {err.get('msg', 'invalid')}", param) from None
    for name, (noop, why) in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if value not in noop and value != {} and value != []:
            raise BadRequest(f"{name}: {why}", name, "unsupported_parameter")
    return body


def sampling_params(body: _Sampling) -> SamplingParams:
    """The body's sampling fields, checked (``max_completion_tokens`` over ``max_tokens``)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    n = body.max_completion_tokens or body.max_tokens or 16
    p = SamplingParams(n, body.temperature, body.top_p, max(body.top_k, 0), stop, body.seed)
    try:
        p.check()
    except ValueError as e:
        raise BadRequest(str(e), str(e).split()[0]) from None
    return p
