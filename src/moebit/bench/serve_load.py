"""The load generator of ``moebit bench serve``: a bounded workload sent only to 127.0.0.1.

    jobs = workload(256)                          # (prompt, max_tokens) pairs
    rec = asyncio.run(load(url, jobs, clients=32))  # tokens/s, TTFT, ITL, lost, 5xx

Closed loop: each of ``clients`` asyncio tasks sends its next request as soon as its last
one ended, so ``clients`` requests are in flight at all times. It shares the host's cores
with the server, so it is kept cheap: a streamed reply is read as raw bytes and split into
server-sent events, and only the last chunk (the one with ``usage``) is parsed as JSON;
every earlier chunk carries text (the server sends none empty), so its arrival is a
token event for the time-to-first-token and inter-token figures.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx


def workload(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: prompts of 4..200 bytes, outputs of 8..128 tokens."""
    rng = random.Random(seed)
    words = ["def", "class", "return", "import", "self", "x", "=", "(", ")", ":", "\n    "]
    out = []
    for _ in range(n):
        length = rng.choice([4, 16, 48, 120, 200])
        text = ""
        while len(text) < length:
            text += rng.choice(words) + " "
        out.append((text[:length], rng.choice([8, 16, 32, 64, 128])))
    return out


def pct(xs: list[float], q: int) -> float | None:
    """The q-th percentile of seconds, in milliseconds (None for no samples)."""
    if not xs:
        return None
    s = sorted(xs)
    return round(1e3 * s[min(len(s) - 1, int(len(s) * q / 100))], 2)


async def _whole_client(http: httpx.AsyncClient, url: str, jobs: asyncio.Queue, rec: dict,
                        extra: dict) -> None:
    """Whole replies (``stream: false``): throughput only, no per-token timings."""
    while not jobs.empty():
        prompt, n = jobs.get_nowait()
        try:
            r = await http.post(url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": n, "temperature": 0, **extra})
        except httpx.HTTPError:
            rec["lost"] += 1
            continue
        if r.status_code >= 500:
            rec["5xx"] += 1
        elif r.status_code == 200:
            rec["done"] += 1
            rec["tokens"] += r.json()["usage"]["completion_tokens"]


def _events(buf: bytes, rec: dict, times: list[float], now: float) -> tuple[bytes, bool]:
    """Consume the whole events in ``buf``; (the unfinished rest, whether [DONE] came)."""
    *events, rest = buf.split(b"\n\n")
    done = False
    for ev in events:
        if ev.startswith(b"data: [DONE]"):
            done = True
        elif b'"usage"' in ev:  # the last chunk: its usage, and maybe the last text
            chunk = json.loads(ev[6:])
            rec["tokens"] += chunk["usage"]["completion_tokens"]
            choice = chunk["choices"][0]
            if choice.get("text") or choice.get("delta", {}).get("content"):
                times.append(now)
        elif ev.startswith(b"data: {"):
            times.append(now)
    return rest, done


async def _stream_client(http: httpx.AsyncClient, url: str, jobs: asyncio.Queue, rec: dict,
                         extra: dict) -> None:
    while not jobs.empty():
        prompt, n = jobs.get_nowait()
        t0 = time.perf_counter()
        times: list[float] = []
        status, done, buf = 0, False, b""
        try:
            async with http.stream("POST", url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                    **extra}) as r:
                status = r.status_code
                async for data in r.aiter_raw():
                    buf, end = _events(buf + data, rec, times, time.perf_counter())
                    done = done or end
        except httpx.HTTPError:
            rec["lost"] += 1
            continue
        if status >= 500:
            rec["5xx"] += 1
        rec["done"] += int(done and status == 200)
        if times:
            rec["ttft"].append(times[0] - t0)
            rec["itl"] += [b - a for a, b in zip(times, times[1:], strict=False)]


async def load(url: str, jobs: list[tuple[str, int]], clients: int,
               stream: bool = True, extra: dict | None = None) -> dict[str, Any]:
    """Send ``jobs`` from ``clients`` concurrent clients; throughput and latency figures.
    ``extra``: fields added to every request (a peer server's own sampling settings)."""
    q: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        q.put_nowait(j)
    rec: dict[str, Any] = {"done": 0, "lost": 0, "5xx": 0, "tokens": 0, "ttft": [], "itl": []}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as http:
        one = _stream_client if stream else _whole_client
        await asyncio.gather(*(one(http, url, q, rec, extra or {}) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": rec["tokens"] / wall, "tokens": rec["tokens"],
            "requests": len(jobs),
            "completed": rec["done"], "lost": rec["lost"], "5xx": rec["5xx"],
            "ttft_p50_ms": pct(rec["ttft"], 50), "ttft_p99_ms": pct(rec["ttft"], 99),
            "itl_p50_ms": pct(rec["itl"], 50), "itl_p99_ms": pct(rec["itl"], 99)}
