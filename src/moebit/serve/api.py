"""The OpenAI-compatible HTTP API on FastAPI: completions, chat, models, health, metrics.

    app = create_app(engine, tokenizer, model_name="runs/a")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Handlers run on the event loop; the engine runs on its own thread. A request's events
cross over into its asyncio queue through one ``loop.call_soon_threadsafe`` per batch of
events (``_Outbox``: a decode step's tokens wake the loop once, not once each). What
takes time in proportion to the prompt (tokenizing, rendering a chat template) runs on a
worker thread, after a prompt too long in bytes to fit the context has been refused, so a
huge prompt never stalls the loop. Errors are OpenAI's ``{"error": {"message", "type",
"param", "code"}}``: 400 for a bad field (named in ``param``), 404/405 for a wrong path or
method, 429 when the queue is full, 500 when this request alone failed, 503 when the
engine is down or draining.
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
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from moebit.inference.sampling import SamplingParams
from moebit.models.tokenizer import ChatTemplateError, Tokenizer
from moebit.serve.engine import Engine, EngineStopped, Event, PromptTooLong, QueueFull, Request
from moebit.serve.schema import BadRequest, ChatBody, CompletionBody, parse_body, sampling_params

BIG_BODY = 1 << 16  # bytes: bodies at least this long are parsed off the event loop
_KINDS = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          429: "rate_limit_error"}


def error(status: int, message: str, param: str | None = None, kind: str | None = None,
          code: str | None = None) -> JSONResponse:
    kind = kind or _KINDS.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def _bad(e: BadRequest) -> JSONResponse:
    return error(400, str(e), e.param, code=e.code)


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

    @app.exception_handler(HTTPException)
    async def _http(http: HTTPRequest, exc: HTTPException) -> JSONResponse:
        what = {404: f"no route {http.url.path}: see /v1/completions, /v1/chat/completions, "
                     "/v1/models, /health, /metrics",
                405: f"method {http.method} is not allowed on {http.url.path}"}
        return error(exc.status_code, what.get(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _crash(_: HTTPRequest, exc: Exception) -> JSONResponse:
        return error(500, f"{type(exc).__name__}: {exc}")

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
    async def completions(http: HTTPRequest) -> Response:
        try:
            body = await _parse(http, CompletionBody)
            params = sampling_params(body)  # the cheap checks first, then the prompt
            prompt = body.prompt
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise BadRequest("prompt: give one string (a list of one string)", "prompt")
                prompt = prompt[0]
            ids = await _tokenize(ctx, prompt)
        except BadRequest as e:
            return _bad(e)
        return await _serve(ctx, body, params, ids, http, chat=False,
                            echo=prompt if body.echo else "")

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest) -> Response:
        try:
            body = await _parse(http, ChatBody)
            params = sampling_params(body)
            apply = getattr(tokenizer, "apply_chat_template", None)
            if apply is None or getattr(tokenizer, "chat_template", None) is None:
                raise BadRequest("this model's tokenizer has no chat template: use "
                                 "/v1/completions", "messages")
            messages = [m.plain() for m in body.messages]
            _check_bytes(ctx, sum(len(str(m.get("content", "")).encode(errors="replace"))
                                   for m in messages))
            try:
                prompt = await asyncio.to_thread(apply, messages)
            except ChatTemplateError as e:
                raise BadRequest(f"messages: {e}", "messages", "invalid_chat_template") from None
            ids = await _tokenize(ctx, prompt)
        except BadRequest as e:
            return _bad(e)
        return await _serve(ctx, body, params, ids, http, chat=True)

    return app


async def _parse(http: HTTPRequest, cls: type) -> Any:
    """The body, parsed and validated; a large one on a worker thread (JSON and pydantic
    take milliseconds per megabyte, which /health and the streams would wait for)."""
    raw = await http.body()
    if len(raw) < BIG_BODY:
        return parse_body(raw, cls)
    return await asyncio.to_thread(parse_body, raw, cls)


def _check_bytes(ctx: dict[str, Any], n_bytes: int) -> None:
    """Refuse, before tokenizing, a text too long in bytes to fit the context in tokens:
    no token stands for more than the tokenizer's ``max_token_bytes``."""
    engine: Engine = ctx["engine"]
    limit = (engine.block_size - 1) * int(getattr(ctx["tok"], "max_token_bytes", 64))
    if n_bytes > limit:
        raise BadRequest(f"prompt: {n_bytes} bytes cannot fit the context of {engine.block_size} "
                         f"tokens (at most {limit} bytes)", "prompt", "context_length_exceeded")


async def _tokenize(ctx: dict[str, Any], text: str) -> list[int]:
    """The prompt's ids, tokenized on a worker thread once its length in bytes can fit; an
    empty prompt starts from the tokenizer's BOS token when it has one."""
    try:
        n_bytes = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise BadRequest(f"prompt: is not valid Unicode text ({e.reason} at character "
                         f"{e.start})", "prompt") from None
    _check_bytes(ctx, n_bytes)
    ids = await asyncio.to_thread(ctx["tok"].encode, text)
    bos = getattr(ctx["tok"], "bos_id", None)
    if not ids and bos is not None:
        ids = [bos]
    if not ids:
        raise BadRequest("prompt: is empty, and this tokenizer has no BOS token to start from",
                         "prompt")
    return ids


async def _serve(ctx: dict[str, Any], body: Any, params: SamplingParams, ids: list[int],
                 http: HTTPRequest, chat: bool, echo: str = "") -> Response:
    engine: Engine = ctx["engine"]
    loop = asyncio.get_running_loop()
    if ctx.get("outbox") is None or ctx["outbox"].loop is not loop:
        ctx["outbox"] = _Outbox(loop)
    bridge = _Bridge(ctx["outbox"])
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    req = Request(rid, ids, params, bridge)
    try:
        engine.submit(req)
    except PromptTooLong as e:
        return error(400, f"prompt: {e}", "prompt", code="context_length_exceeded")
    except ValueError as e:
        return error(400, str(e), str(e).split()[0], code="invalid_value")
    except QueueFull as e:
        return error(429, f"{e}; retry later", kind="rate_limit_error")
    except EngineStopped as e:
        return error(503, str(e), kind="server_error")
    meta = {"id": rid, "created": int(time.time()), "model": ctx["name"], "chat": chat,
            "prompt_tokens": len(ids), "echo": echo}
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
    if ev.status == 500:
        return error(500, f"this request failed: {ev.error}")
    return error(503, f"the engine failed: {ev.error}")


async def _whole(ctx: dict[str, Any], req: Request, bridge: _Bridge, http: HTTPRequest,
                 meta: dict[str, Any]) -> Response:
    """Wait for the whole text; a client that leaves meanwhile cancels its request."""
    parts: list[str] = [meta["echo"]]
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
        if meta["echo"]:  # the prompt's text first, as OpenAI's echo
            chunk = {**head, "choices": [_choice(meta, meta["echo"], None, True, True)]}
            yield f"data: {json.dumps(chunk)}\n\n"
        while True:
            ev = await bridge.queue.get()
            if ev.finish_reason == "error":
                what = "this request failed" if ev.status == 500 else "the engine failed"
                err = {"message": f"{what}: {ev.error}", "type": "server_error",
                       "param": None, "code": ev.status}
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
