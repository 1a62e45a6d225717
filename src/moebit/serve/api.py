"""The OpenAI-compatible HTTP API on FastAPI: completions, chat, models, health, metrics.

    app = create_app(engine, tokenizer, model_name="runs/a")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Handlers run on the event loop; the engine runs on its own thread. A request's events
cross over into its asyncio queue through one ``loop.call_soon_threadsafe`` per batch of
events (``_Outbox``: a decode step's tokens wake the loop once, not once each). Errors are
OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad field (named
in ``param``), 429 when the queue is full, 503 when the engine is down or draining.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from moebit.inference.sampling import SamplingParams
from moebit.models.tokenizer import Tokenizer
from moebit.serve.engine import Engine, EngineStopped, Event, QueueFull, Request


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)


class CompletionBody(_Sampling):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def error(status: int, message: str, param: str | None = None,
          kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def _params(body: _Sampling) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    p = SamplingParams(body.max_tokens, body.temperature, body.top_p, max(body.top_k, 0),
                       stop, body.seed)
    p.check()
    return p


class _Outbox:
    """Events from the engine thread to the event loop, with one wake-up per batch.

    A decode step ends with an event for each of its requests; waking the loop once per
    event (``call_soon_threadsafe`` writes to its self-pipe each time) would cost a
    system call and a loop iteration per token. The first event of a batch schedules a
    delivery; the others, arriving before the loop runs it, only join the list.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.lock = loop, threading.Lock()
        self.pending: list[tuple[asyncio.Queue[Event], Event]] = []

    def put(self, queue: asyncio.Queue[Event], ev: Event) -> None:
        with self.lock:
            self.pending.append((queue, ev))
            if len(self.pending) > 1:
                return  # a delivery is already scheduled and will take this one too
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
        for queue, ev in items:
            queue.put_nowait(ev)


class _Bridge:
    """One request's events, from the engine thread into this request's asyncio queue."""

    def __init__(self, outbox: _Outbox) -> None:
        self.outbox, self.queue = outbox, asyncio.Queue[Event]()

    def __call__(self, ev: Event) -> None:
        self.outbox.put(self.queue, ev)


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    """The app serving ``engine`` (a failed engine makes every answer a 503)."""
    app = FastAPI(title="moebit serve")
    ctx = {"name": model_name, "engine": engine, "tok": tokenizer}

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON: {err.get('msg', '')}")
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not isinstance(x, int)]
        param = loc[0] if loc else None
        return error(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param)

    @app.get("/health")
    async def health() -> Response:
        if engine.failed is not None:
            return error(503, f"engine failed: {engine.failed}", kind="server_error")
        if engine.stopping:
            return error(503, "the server is shutting down", kind="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "moebit",
             "max_model_len": engine.block_size}]})

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest) -> Response:
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                return error(400, "prompt: give one string (a list of one string)", "prompt")
            prompt = prompt[0]
        return await _serve(ctx, body, prompt, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HTTPRequest) -> Response:
        apply = getattr(tokenizer, "apply_chat_template", None)
        if apply is None or getattr(tokenizer, "chat_template", None) is None:
            return error(400, "this model's tokenizer has no chat template: use /v1/completions",
                         "messages")
        prompt = apply([m.model_dump() for m in body.messages])
        return await _serve(ctx, body, prompt, http, chat=True)

    return app


async def _serve(ctx: dict[str, Any], body: _Sampling, prompt: str, http: HTTPRequest,
                 chat: bool) -> Response:
    engine: Engine = ctx["engine"]
    try:
        params = _params(body)
    except ValueError as e:
        return error(400, str(e), str(e).split()[0])
    ids = ctx["tok"].encode(prompt)
    loop = asyncio.get_running_loop()
    if ctx.get("outbox") is None or ctx["outbox"].loop is not loop:
        ctx["outbox"] = _Outbox(loop)
    bridge = _Bridge(ctx["outbox"])
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    req = Request(rid, ids, params, bridge)
    try:
        engine.submit(req)
    except ValueError as e:
        return error(400, f"prompt: {e}", "prompt", code="context_length_exceeded")
    except QueueFull as e:
        return error(429, f"{e}; retry later", kind="rate_limit_error")
    except EngineStopped as e:
        return error(503, str(e), kind="server_error")
    meta = {"id": rid, "created": int(time.time()), "model": ctx["name"], "chat": chat,
            "prompt_tokens": len(ids)}
    if body.stream:
        return StreamingResponse(_stream(ctx, req, bridge, meta), media_type="text/event-stream")
    return await _whole(ctx, req, bridge, http, meta)


def _choice(meta: dict[str, Any], text: str, reason: str | None, first: bool = False,
            stream: bool = False) -> dict[str, Any]:
    if not meta["chat"]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if stream:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}


def _usage(meta: dict[str, Any], req: Request) -> dict[str, int]:
    n = req.completion_tokens
    return {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": n,
            "total_tokens": meta["prompt_tokens"] + n}


def _failed(ev: Event) -> JSONResponse:
    return error(503, f"the engine failed: {ev.error}", kind="server_error")


async def _whole(ctx: dict[str, Any], req: Request, bridge: _Bridge, http: HTTPRequest,
                 meta: dict[str, Any]) -> Response:
    """Wait for the whole text; a client that leaves meanwhile cancels its request."""
    parts: list[str] = []
    while True:
        try:
            ev = await asyncio.wait_for(bridge.queue.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                req.cancelled = True
                return Response(status_code=499)
            continue
        parts.append(ev.text)
        if ev.finish_reason == "error":
            return _failed(ev)
        if ev.finish_reason is not None:
            break
    obj = "chat.completion" if meta["chat"] else "text_completion"
    return JSONResponse({"id": meta["id"], "object": obj, "created": meta["created"],
                         "model": meta["model"],
                         "choices": [_choice(meta, "".join(parts), ev.finish_reason)],
                         "usage": _usage(meta, req)})


async def _stream(ctx: dict[str, Any], req: Request, bridge: _Bridge,
                  meta: dict[str, Any]) -> AsyncIterator[str]:
    """Server-sent events; the last chunk carries the usage, then ``data: [DONE]``. A
    client that disconnects ends this generator, which cancels the request."""
    obj = "chat.completion.chunk" if meta["chat"] else "text_completion"
    head = {"id": meta["id"], "object": obj, "created": meta["created"], "model": meta["model"]}
    first, finished = True, False
    try:
        while True:
            ev = await bridge.queue.get()
            if ev.finish_reason == "error":
                err = {"message": f"the engine failed: {ev.error}", "type": "server_error",
                       "param": None, "code": 503}
                finished = True
                yield f"data: {json.dumps({'error': err})}\n\n"
                break
            chunk = {**head, "choices": [_choice(meta, ev.text, ev.finish_reason, first, True)]}
            if ev.finish_reason is not None:
                chunk["usage"] = _usage(meta, req)
            first = False
            finished = ev.finish_reason is not None
            yield f"data: {json.dumps(chunk)}\n\n"
            if ev.finish_reason is not None:
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client left (or the server stopped it) mid-stream
            req.cancelled = True
