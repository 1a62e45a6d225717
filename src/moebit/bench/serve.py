"""``moebit bench serve``: continuous batching over HTTP against static batching.

    moebit bench serve --json serve.json                       # a random MoE model
    moebit bench serve --run runs/a --clients 1 8 32 --requests 64
    moebit bench serve --hf --json serve-hf.json               # + transformers generate
    moebit bench serve --peer llamacpp --clients 1 16 --threads 2   # against llama.cpp

A load generator of its own (asyncio + httpx, streamed replies, a bounded number of
requests, only to 127.0.0.1) drives a real ``moebit serve`` subprocess at 1, 8 and 32
concurrent clients with mixed prompt and output lengths, and measures output tokens/s,
time to first token and inter-token latency (p50/p99), lost requests and 5xx replies;
``--no-stream``: whole replies, throughput only (no per-token events to send and parse).

The baseline is static batching, ``moebit generate --batch C``: the same prompts through
``generate_tokens`` in batches of C (one max-new-tokens per batch, as the CLI takes one;
only the tokens each request asked for count as output). The server and the baselines
each get ``--threads`` torch threads (default 1); they run interleaved, rep by rep, so a
loaded host hits all. ``--engine``, ``--max-batch-tokens`` and ``--prefix-cache-tokens``
go to the server as they are (``--engine legacy``: the engine before ragged batching).

Beside the measured ratio, each client level gets ``decode_bound`` (``serve_bound``): the
most continuous batching could gain over static batching on this machine, replayed from
the baseline model's decode step times at 1, 2, 4, ... rows (``step_ms_by_rows``):
``bound`` against the baseline as measured (every row of a batch computed to its
longest request), ``bound_vs_live`` against a static batcher that drops finished rows.

``--hf`` (a random Mixtral built by transformers) or ``--run HF_DIR``: the server serves a
Hugging Face folder, and transformers' ``generate`` on the same weights and prompts is a
second baseline (``moebit.bench.serve_hf``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

from moebit.bench import serve_bound, serve_hf
from moebit.bench.serve_load import load, pct, workload
from moebit.comm._native import cpu_model, select_isa
from moebit.comm.collectives import DistInfo
from moebit.inference.generate import generate_tokens
from moebit.inference.loading import load_model
from moebit.models.gpt import GPT
from moebit.models.hf import from_pretrained, is_hf_folder
from moebit.models.registry import new_model
from moebit.testing import free_port
from moebit.training.config import build
from moebit.training.data import TrainBatches
from moebit.training.state import save

SYNTHETIC = {"n_layer": 4, "n_head": 4, "d_model": 128, "block_size": 512,
             "num_experts": 8, "moe_every": 2}


def synthetic_run(folder: Path) -> Path:
    """A run folder with a random MoE GPT (timing only needs the architecture)."""
    cfg = build({**SYNTHETIC, "samples": 0, "run_dir": str(folder)})
    torch.manual_seed(0)
    model = new_model(cfg.model_config())
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    save(folder, 1, model, torch.optim.Adam(model.parameters()),
         TrainBatches(np.arange(1000, dtype=np.uint8), 32, 2, 0, 0),
         DistInfo(0, 1, 0, torch.device("cpu"), None), cfg, wall=0.0, train_time=0.0)
    return folder


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
            "ttft_p50_ms": pct(firsts, 50), "ttft_p99_ms": pct(firsts, 99)}


def wait_ready(url: str, proc: subprocess.Popen, what: str, path: str = "/health") -> None:
    """Wait until ``url + path`` answers 200 (up to about 3 minutes); a server that exits
    or never answers is killed and named."""
    for _ in range(900):
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{what} did not start (exit code {proc.poll()})")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def start_server(run: Path, max_batch: int, *flags: str) -> tuple[subprocess.Popen, str]:
    """``moebit serve RUN`` at a free 127.0.0.1 port, once it answers /health."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moebit.cli", "serve", str(run),
                             "--port", str(port), "--max-batch", str(max_batch),
                             "--max-queue", "1024", *flags])
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "moebit serve")
    return proc, url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moebit bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a run folder or a Hugging Face folder (default: a random "
                                  "MoE model)")
    ap.add_argument("--hf", action="store_true",
                    help="a random Hugging Face Mixtral (needs transformers); adds the "
                         "transformers generate baseline")
    ap.add_argument("--hf-cache", choices=("dynamic", "static"), default="dynamic",
                    help="transformers generate's KV cache")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64,
                    help="requests per measurement, at least 8 per client (bounded: 2000)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server and "
                                                           "of each baseline")
    ap.add_argument("--engine", choices=("ragged", "legacy"), default="ragged",
                    help="the server's engine (legacy: a decode and a prefill forward per step)")
    ap.add_argument("--max-batch-tokens", type=int, default=256, help="the server's step budget")
    ap.add_argument("--prefix-cache-tokens", type=int, default=4096,
                    help="the server's prefix cache (0: off)")
    ap.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                    help="with a Hugging Face folder, transformers' generate as a second baseline")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="streamed replies (TTFT and inter-token latency), or whole ones")
    ap.add_argument("--peer", choices=("none", "llamacpp"), default="none",
                    help="llamacpp: moebit serve against llama-cpp-python's server on the "
                         "same weights (moebit.bench.serve_llamacpp), instead of the baselines")
    ap.add_argument("--peer-config", choices=("e8", "e64", "tiny"), default="e64",
                    help="--peer: the byte-vocabulary Mixtral both serve (bench decode's)")
    ap.add_argument("--peer-qtypes", nargs="+",
                    choices=("F32", "Q8_0", "Q4_0", "Q8_0_a8", "Q4_0_a8"),
                    default=["F32", "Q8_0"], help="--peer: GGUF types, each against moebit "
                    "float32 / --quantize int8 / int4 (Q8_0_a8 / Q4_0_a8: int8 / int4 with "
                    "--activations int8)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= 2000 or min(args.clients) < 1 or args.threads < 1:
        raise ValueError("--requests must lie in 1..2000, --clients and --threads be >= 1")
    torch.set_num_threads(args.threads)
    if args.peer == "llamacpp":
        from moebit.bench import serve_llamacpp

        out = serve_llamacpp.run(args)
        out["host"] = {"cpus": os.cpu_count(), "cpu": cpu_model(), "isa": select_isa(),
                       "loadavg": os.getloadavg()}
        print(json.dumps(out, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.run:
            run = Path(args.run)
        elif args.hf:
            run = serve_hf.synthetic_hf_folder(Path(tmp))
        else:
            run = synthetic_run(Path(tmp))
        hf = is_hf_folder(run)
        model = from_pretrained(run) if hf else load_model(run)
        if hf:
            model.config.block_size = 512  # the server's --context
        baselines = (_hf_baselines(model, run, args.hf_cache, args.transformers) if hf
                     else _moebit_baseline(model))
        flags = ["--threads", str(args.threads), "--engine", args.engine,
                 "--max-batch-tokens", str(args.max_batch_tokens),
                 "--prefix-cache-tokens", str(args.prefix_cache_tokens)]
        # an HF folder: slots as long as the synthetic run's context, not the default 2048
        proc, url = start_server(run, args.max_batch, *flags,
                                 *(["--context", "512"] if hf else []))
        try:
            out = _measure(args, url, baselines)
        finally:
            stop_server(proc)
        _add_bounds(out, model, args)
    out["server"] = {"engine": args.engine, "max_batch_tokens": args.max_batch_tokens,
                     "prefix_cache_tokens": args.prefix_cache_tokens, "threads": args.threads}
    out["host"] = {"cpus": os.cpu_count(), "loaded": "shared with other jobs",
                   "model": args.run or (serve_hf.MIXTRAL if args.hf else SYNTHETIC)}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


Baseline = Any  # (jobs, batch) -> figures with tokens_per_s


def _moebit_baseline(model: GPT) -> dict[str, Baseline]:
    return {"static": lambda jobs, c: static(model, jobs, c)}


def _hf_baselines(ours: Any, folder: Path, cache: str,
                  transformers: bool = True) -> dict[str, Baseline]:
    """Static batching through moebit (``ours``: the folder loaded by moebit) and
    (``transformers``) transformers' generate, on the folder's weights."""

    def ids(jobs: list[tuple[str, int]]) -> tuple[list[list[int]], list[int]]:
        return serve_hf.encode_jobs(folder, jobs), [n for _, n in jobs]

    out = {"static": lambda jobs, c: serve_hf.static_ids(ours, *ids(jobs), c)}
    if transformers:
        theirs = serve_hf.load_transformers(folder)
        out["transformers"] = lambda jobs, c: serve_hf.transformers_generate(
            theirs, *ids(jobs), c, cache)
    return out


def _add_bounds(out: dict[str, Any], model: Any, args: argparse.Namespace) -> None:
    """Each client level's ``decode_bound`` (``serve_bound``): the most the server could
    gain over static batching here, from this machine's step times at 1, 2, 4, ... rows."""
    slots = {c: min(c, args.max_batch) for c in args.clients}
    costs = serve_bound.step_costs(model, max(slots.values()),
                                   getattr(model.config, "vocab_size", 256))
    out["step_ms_by_rows"] = {str(n): round(ms, 3) for n, ms in costs.items()}
    for c in args.clients:
        budgets = [n for _, n in workload(min(2000, max(args.requests, 8 * c)), seed=0)]
        out["clients"][str(c)]["decode_bound"] = serve_bound.decode_bound(budgets, c, slots[c], costs)


def _measure(args: argparse.Namespace, url: str, baselines: dict[str, Baseline]) -> dict[str, Any]:
    names = ["serve", *baselines]
    reps: dict[int, dict[str, list[dict]]] = {c: {k: [] for k in names} for c in args.clients}
    asyncio.run(load(url, workload(8, seed=99), 4))  # warm-up
    for rep in range(args.reps):
        for c in args.clients:
            jobs = workload(min(2000, max(args.requests, 8 * c)), seed=rep)
            reps[c]["serve"].append(asyncio.run(load(url, jobs, c, args.stream)))
            for name, run in baselines.items():
                reps[c][name].append(run(jobs, c))
    summary = {}
    for c, r in reps.items():
        med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in r.items()}
        row: dict[str, Any] = {k: r[k][-1] for k in names}
        for k in names:
            row[f"{k}_tokens_per_s_median"] = round(med[k], 1)
        row["ratio"] = round(med["serve"] / med["static"], 2)
        if "transformers" in med:
            row["ratio_vs_transformers"] = round(med["serve"] / med["transformers"], 2)
        row["lost"] = sum(x["lost"] for x in r["serve"])
        row["5xx"] = sum(x["5xx"] for x in r["serve"])
        row["incomplete"] = sum(x["requests"] - x["completed"] for x in r["serve"])
        summary[str(c)] = row
    return {"clients": summary, "reps": args.reps, "requests": args.requests,
            "stream": args.stream}
