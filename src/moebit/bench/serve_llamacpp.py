"""``moebit bench serve --peer llamacpp``: moebit's server against llama.cpp's, same weights.

    moebit bench serve --peer llamacpp --peer-config e64 --clients 1 8 16 --threads 2

One random Mixtral-style folder with a byte vocabulary (``moebit bench decode``'s
configurations, ``decode.build_folder``) is served two ways over HTTP on 127.0.0.1:

- ``moebit serve FOLDER`` (continuous batching), float32 or ``--quantize int8|int4``;
- llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``, the
  optional ``llamacpp`` extra with its server dependencies) on GGUF files written from
  the same weights (``gguf_convert``): F32 against moebit float32, Q8_0 against int8,
  Q4_0 against int4.

Both tokenize a prompt to its bytes: the folder gets a ``tokenizer.json`` whose token i is
byte i (``byte_tokenizer``), and the GGUF files hold the same vocabulary (GPT-2's byte-level
BPE alphabet, no merges, no BOS), so llama.cpp reads the same ids. Both get the same threads, the
same requests (``serve_load.workload``) from the same closed-loop load generator, plain
greedy (llama-cpp-python's default repetition penalty of 1.1 set to 1.0),
whole replies (``stream: false``: each reply's ``usage`` counts its tokens, which llama.cpp's
streamed chunks do not carry), and run interleaved, rep by rep.

What each server does with concurrent requests is part of the measurement:
llama-cpp-python 0.3.x's server holds one ``Llama`` context and serves one completion at
a time (a lock around the model), so its throughput stays that of batch-1 decoding at any
client count, while moebit's engine decodes every running request in one forward. A
llama.cpp GGUF vocabulary always has an end-of-text id (for this one byte 11 by default),
so its replies may end early; tokens/s counts the tokens each reply carried, and the rows
give the mean per reply.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from moebit.bench import decode_llamacpp
from moebit.bench.serve import start_server, stop_server, wait_ready
from moebit.bench.serve_load import load, workload
from moebit.testing import free_port

# row -> (the GGUF type llama.cpp serves, moebit serve's flags on the same weights);
# Q8_0_a8 / Q4_0_a8: moebit's int8 / int4 products on 8-bit activations, llama.cpp's own
# arithmetic for Q8_0 / Q4_0
PAIRS = {"F32": ("F32", ["--quantize", "none"]), "Q8_0": ("Q8_0", ["--quantize", "int8"]),
         "Q4_0": ("Q4_0", ["--quantize", "int4"]),
         "Q8_0_a8": ("Q8_0", ["--quantize", "int8", "--activations", "int8"]),
         "Q4_0_a8": ("Q4_0", ["--quantize", "int4", "--activations", "int8"])}
# llama-cpp-python's server applies a repetition penalty of 1.1 by default; plain greedy
# decoding (moebit's) is 1.0
PLAIN_GREEDY = {"llamacpp": {"repeat_penalty": 1.0}, "moebit": {}}


def available() -> str | None:
    """None when llama-cpp-python and its server import; else why not."""
    why = decode_llamacpp.available()
    if why is not None:
        return why
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as e:
        return (f"the llama.cpp server peer needs llama-cpp-python's server dependencies "
                f"(pip install 'moebit[llamacpp]'): {e}")
    return None


def byte_tokenizer(folder: Path) -> Path:
    """A ``tokenizer.json`` in ``folder`` whose token i is byte i (GPT-2's byte-level BPE
    with no merges and no special tokens, as the GGUF files hold it): what the
    byte-vocabulary benchmark folders need to be served."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from moebit.bench.gguf_convert import byte_level_alphabet

    vocab = {ch: i for i, ch in enumerate(byte_level_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def start_llamacpp(gguf: Path, threads: int, n_ctx: int) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's server on ``gguf`` at a free 127.0.0.1 port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
         "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
         "--n_ctx", str(n_ctx), "--n_batch", "512", "--verbose", "False"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "llama_cpp.server", "/v1/models")
    return proc, url


def _first_text(url: str, extra: dict) -> str:
    """One greedy reply to a fixed prompt (the agreement check between the servers)."""
    r = httpx.post(url + "/v1/completions", timeout=300,
                   json={"prompt": "def main():", "max_tokens": 16, "temperature": 0, **extra})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def agreement(ours: str, theirs: str) -> dict[str, Any]:
    """Whether two greedy replies agree: moebit writes an undecodable byte as U+FFFD and
    llama-cpp-python drops it (and decodes on until its text ends a character), so the
    decodable text of one must begin the other's."""
    a, b = ours.replace("\ufffd", ""), theirs
    return {"moebit": ours, "llamacpp": theirs, "compared_chars": min(len(a), len(b)),
            "agree": a.startswith(b) or b.startswith(a)}


def run(args: Any) -> dict[str, Any]:
    """Every (GGUF type, client count) row, servers started once per type."""
    import tempfile

    from moebit.bench.decode import build_folder
    from moebit.bench.gguf_convert import write_gguf
    from moebit.models.hf import from_pretrained

    why = available()
    if why is not None:
        raise RuntimeError(why)
    context = 512
    out: dict[str, Any] = {"config": args.peer_config, "threads": args.threads,
                           "clients": args.clients, "requests": args.requests,
                           "reps": args.reps, "stream": False, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="moebit-bench-serve-llamacpp-") as tmp:
        folder = Path(tmp) / args.peer_config
        build_folder(args.peer_config, folder)
        byte_tokenizer(folder)
        model = from_pretrained(str(folder))
        for qtype in args.peer_qtypes:
            gtype, flags = PAIRS[qtype]
            gguf = Path(tmp) / f"model-{gtype}.gguf"
            if not gguf.exists():
                write_gguf(model, gguf, gtype)
            ours, ours_url = start_server(folder, args.max_batch, "--threads", str(args.threads),
                                          *flags, "--context", str(context))
            try:
                # llama-cpp-python decodes on past max_tokens while its text ends inside
                # a UTF-8 sequence (random weights write many): room for that
                theirs, theirs_url = start_llamacpp(gguf, args.threads, 4 * context)
                try:
                    out["rows"][qtype] = _measure(args, ours_url, theirs_url)
                    a = _first_text(ours_url, PLAIN_GREEDY["moebit"])
                    b = _first_text(theirs_url, PLAIN_GREEDY["llamacpp"])
                    out["rows"][qtype]["greedy_agreement"] = agreement(a, b)
                finally:
                    stop_server(theirs)
            finally:
                stop_server(ours)
            print(f"serve vs llama.cpp {qtype}: " + json.dumps(
                {c: r["tokens_per_s_ratio"] for c, r in out["rows"][qtype]["clients"].items()}),
                file=sys.stderr, flush=True)
    return out


def _measure(args: Any, ours: str, theirs: str) -> dict[str, Any]:
    urls = {"moebit": ours, "llamacpp": theirs}
    for name, url in urls.items():  # warm-up: first requests build kernels and caches
        asyncio.run(load(url, workload(4, seed=99), 2, False, PLAIN_GREEDY[name]))
    reps: dict[int, dict[str, list[dict]]] = {c: {k: [] for k in urls} for c in args.clients}
    for rep in range(args.reps):
        for c in args.clients:
            jobs = workload(min(2000, max(args.requests, 4 * c)), seed=rep)
            for name, url in urls.items():
                rec = asyncio.run(load(url, jobs, c, False, PLAIN_GREEDY[name]))
                rec["mean_tokens_per_reply"] = round(rec["tokens"] / max(1, rec["completed"]), 1)
                reps[c][name].append(rec)
    rows = {}
    for c, r in reps.items():
        med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in r.items()}
        rows[str(c)] = {
            **{f"{k}_tokens_per_s": round(v, 1) for k, v in med.items()},
            "tokens_per_s_ratio": round(med["moebit"] / med["llamacpp"], 2),
            **{f"{k}_last": v[-1] for k, v in r.items()},
        }
    return {"clients": rows}
