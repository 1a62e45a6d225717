"""``moebit bench serve``: continuous batching over HTTP against static batching.

    moebit bench serve --json serve.json                       # a random MoE model
    moebit bench serve --run runs/a --clients 1 8 32 --requests 64

A load generator of its own (asyncio + httpx, streamed replies, a bounded number of
requests, only to 127.0.0.1) drives a real ``moebit serve`` subprocess at 1, 8 and 32
concurrent clients with mixed prompt and output lengths, and measures output tokens/s,
time to first token and inter-token latency (p50/p99), lost requests and 5xx replies;
``--no-stream``: whole replies, throughput only (no per-token events to send and parse).

The baseline is static batching, ``moebit generate --batch C``: the same prompts through
``generate_tokens`` in batches of C (one max-new-tokens per batch, as the CLI takes one;
only the tokens each request asked for count as output). The server and the baseline
each get one torch thread; they run interleaved, rep by rep, so a loaded host hits both.

transformers' ``generate`` is not compared: a moebit MoE GPT has no Hugging Face
architecture to load the same weights into (the byte-level dense GPT is not GPT-2 either:
its vocabulary, embeddings and block layout differ).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from moebit.checkpoint.train_state import save
from moebit.comm.collectives import DistInfo
from moebit.config import build
from moebit.data import TrainBatches
from moebit.generate import generate_tokens
from moebit.loading import load_model
from moebit.models.gpt import GPT
from moebit.testing import free_port

SYNTHETIC = {"n_layer": 4, "n_head": 4, "d_model": 128, "block_size": 512,
             "num_experts": 8, "moe_every": 2}


def synthetic_run(folder: Path) -> Path:
    """A run folder with a random MoE GPT (timing only needs the architecture)."""
    cfg = build({**SYNTHETIC, "samples": 0, "run_dir": str(folder)})
    torch.manual_seed(0)
    model = GPT(cfg.model_config())
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    save(folder, 1, model, torch.optim.Adam(model.parameters()),
         TrainBatches(np.arange(1000, dtype=np.uint8), 32, 2, 0, 0),
         DistInfo(0, 1, 0, torch.device("cpu"), None), cfg, wall=0.0, train_time=0.0)
    return folder


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


async def _whole_client(http: httpx.AsyncClient, url: str, jobs: asyncio.Queue, rec: dict) -> None:
    """Whole replies (``stream: false``): throughput only, no per-token timings."""
    while not jobs.empty():
        prompt, n = jobs.get_nowait()
        try:
            r = await http.post(url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": n, "temperature": 0})
        except httpx.HTTPError:
            rec["lost"] += 1
            continue
        if r.status_code >= 500:
            rec["5xx"] += 1
        elif r.status_code == 200:
            rec["done"] += 1
            rec["tokens"] += r.json()["usage"]["completion_tokens"]


async def _client(http: httpx.AsyncClient, url: str, jobs: asyncio.Queue, rec: dict) -> None:
    while not jobs.empty():
        prompt, n = jobs.get_nowait()
        t0 = time.perf_counter()
        times, status = [], 0
        try:
            async with http.stream("POST", url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"][0]["text"]:
                            times.append(time.perf_counter())
                        if "usage" in chunk:
                            rec["tokens"] += chunk["usage"]["completion_tokens"]
                    elif line == "data: [DONE]":
                        rec["done"] += 1
        except httpx.HTTPError:
            rec["lost"] += 1
            continue
        if status >= 500:
            rec["5xx"] += 1
        if times:
            rec["ttft"].append(times[0] - t0)
            rec["itl"] += [b - a for a, b in zip(times, times[1:], strict=False)]


async def _load(url: str, jobs: list[tuple[str, int]], clients: int,
                stream: bool = True) -> dict[str, Any]:
    q: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        q.put_nowait(j)
    rec: dict[str, Any] = {"done": 0, "lost": 0, "5xx": 0, "tokens": 0, "ttft": [], "itl": []}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as http:
        one = _client if stream else _whole_client
        await asyncio.gather(*(one(http, url, q, rec) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": rec["tokens"] / wall, "requests": len(jobs),
            "completed": rec["done"], "lost": rec["lost"], "5xx": rec["5xx"],
            "ttft_p50_ms": _pct(rec["ttft"], 50), "ttft_p99_ms": _pct(rec["ttft"], 99),
            "itl_p50_ms": _pct(rec["itl"], 50), "itl_p99_ms": _pct(rec["itl"], 99)}


def _pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(1e3 * s[min(len(s) - 1, int(len(s) * q / 100))], 2)


def static(model: GPT, jobs: list[tuple[str, int]], batch: int) -> dict[str, Any]:
    """``moebit generate --batch B`` on the same prompts: batches in arrival order, each
    decoded to its longest request's length; tokens/s counts only the requested tokens."""
    t0 = time.perf_counter()
    firsts = []
    for i in range(0, len(jobs), batch):
        chunk = jobs[i:i + batch]
        ts = time.perf_counter()
        res = generate_tokens(model, [list(p.encode()) for p, _ in chunk],
                              max(n for _, n in chunk), temperature=0, batch_size=batch)
        firsts += [ts - t0 + res.prefill_s] * len(chunk)  # queued since t0, first token after prefill
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": sum(n for _, n in jobs) / wall,
            "ttft_p50_ms": _pct(firsts, 50), "ttft_p99_ms": _pct(firsts, 99)}


def _start_server(run: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moebit.cli", "serve", str(run),
                             "--port", str(port), "--threads", "1", "--max-batch", str(max_batch),
                             "--max-queue", "1024"])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("moebit serve did not start")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moebit bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a run folder (default: a random MoE model)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64,
                    help="requests per measurement, at least 8 per client (bounded: 2000)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="streamed replies (TTFT and inter-token latency), or whole ones")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= 2000 or min(args.clients) < 1:
        raise ValueError("--requests must lie in 1..2000 and --clients be >= 1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.run) if args.run else synthetic_run(Path(tmp))
        model = load_model(run)
        proc, url = _start_server(run, args.max_batch)
        try:
            out = _measure(args, url, model)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    out["host"] = {"cpus": os.cpu_count(), "loaded": "shared with other jobs",
                   "model": args.run or SYNTHETIC}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _measure(args: argparse.Namespace, url: str, model: GPT) -> dict[str, Any]:
    reps: dict[int, dict[str, list[dict]]] = {c: {"serve": [], "static": []} for c in args.clients}
    asyncio.run(_load(url, workload(8, seed=99), 4))  # warm-up
    for rep in range(args.reps):
        for c in args.clients:
            jobs = workload(min(2000, max(args.requests, 8 * c)), seed=rep)
            reps[c]["serve"].append(asyncio.run(_load(url, jobs, c, args.stream)))
            reps[c]["static"].append(static(model, jobs, c))
    summary = {}
    for c, r in reps.items():
        med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in r.items()}
        summary[str(c)] = {"serve": r["serve"][-1], "static": r["static"][-1],
                           "serve_tokens_per_s_median": round(med["serve"], 1),
                           "static_tokens_per_s_median": round(med["static"], 1),
                           "ratio": round(med["serve"] / med["static"], 2),
                           "lost": sum(x["lost"] for x in r["serve"]),
                           "5xx": sum(x["5xx"] for x in r["serve"])}
    return {"clients": summary, "reps": args.reps, "requests": args.requests,
            "stream": args.stream}
