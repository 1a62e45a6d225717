"""The memory-bandwidth floor of one decode step: bytes of weights a token must read over
the bytes per second this machine reads.

At batch 1 a decode step multiplies one activation row by every weight it touches, so it
can be no faster than reading those weights once from memory: the attention projections,
the norms and the router of every layer, the k experts each MoE layer routes the token to,
one row of the embedding and the whole output head. ``weight_bytes`` counts them for a
Mixtral-style Hugging Face config at a given storage format per part (a ``Scheme``);
``read_bandwidth`` measures the machine's streaming read rate with the given threads.
KV-cache reads grow with the context and are reported apart (``kv_bytes``), as they are
not weights.

Formats, bytes of an [N, K] matrix (N outputs, K inputs):

- ``f32``: 4 N K.
- ``int8c``: moebit int8, one float32 scale per output channel: N K + 4 N.
- ``int4g32``: moebit int4, one float32 scale per 32 inputs: N Kp / 2 + 4 N Kp / 32
  (Kp: K rounded up to 32).
- ``q8_0`` / ``q4_0``: GGML blocks of 32 weights with an fp16 scale: 34 / 18 bytes a block.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

FORMATS = ("f32", "int8c", "int4g32", "q8_0", "q4_0")


def matrix_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes one [n, k] weight matrix takes in ``fmt`` (module docstring)."""
    blocks = math.ceil(k / 32)
    if fmt == "f32":
        return 4 * n * k
    if fmt == "int8c":
        return n * k + 4 * n
    if fmt == "int4g32":
        return n * blocks * 16 + 4 * n * blocks
    if fmt == "q8_0":
        return n * blocks * 34
    if fmt == "q4_0":
        return n * blocks * 18
    raise ValueError(f"unknown weight format {fmt!r}: choose from {', '.join(FORMATS)}")


@dataclass(frozen=True)
class Scheme:
    """Storage format of each part of the model (norms are always float32)."""

    name: str
    attention: str = "f32"
    router: str = "f32"
    experts: str = "f32"
    embedding: str = "f32"
    head: str = "f32"


SCHEMES = {
    "moebit_fp32": Scheme("moebit_fp32"),
    "moebit_int8": Scheme("moebit_int8", experts="int8c"),
    "moebit_int4": Scheme("moebit_int4", experts="int4g32"),
    "moebit_int8_all": Scheme("moebit_int8_all", "int8c", "f32", "int8c", "f32", "int8c"),
    "moebit_int4_all": Scheme("moebit_int4_all", "int4g32", "f32", "int4g32", "f32", "int4g32"),
    # convert_hf_to_gguf / llama.cpp keep the router (ffn_gate_inp) and norms in F32
    "llamacpp_f32": Scheme("llamacpp_f32"),
    "llamacpp_q8_0": Scheme("llamacpp_q8_0", "q8_0", "f32", "q8_0", "q8_0", "q8_0"),
    "llamacpp_q4_0": Scheme("llamacpp_q4_0", "q4_0", "f32", "q4_0", "q4_0", "q4_0"),
}


@dataclass(frozen=True)
class Dims:
    """What the floor needs of a Mixtral-style config."""

    d: int  # hidden_size
    f: int  # intermediate_size (one expert)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    k: int  # experts per token
    vocab: int
    tied: bool

    @staticmethod
    def of_config(cfg: dict[str, Any]) -> Dims:
        """From a config.json dict (Mixtral's keys); names the missing key."""
        try:
            d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return Dims(d, int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"]),
                        heads, int(cfg.get("num_key_value_heads") or heads),
                        int(cfg.get("head_dim") or d // heads),
                        int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                        int(cfg["vocab_size"]), bool(cfg.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise ValueError(f"config.json: missing key {e.args[0]!r} (a Mixtral-style "
                             f"config is needed for the bandwidth floor)") from None


def weight_bytes(dims: Dims, scheme: Scheme) -> dict[str, int]:
    """Bytes of weights one token reads, by part, and their ``total``."""
    d, dh = dims.d, dims.head_dim
    q_out, kv_out = dims.heads * dh, dims.kv_heads * dh
    attn = (matrix_bytes(scheme.attention, q_out, d) + 2 * matrix_bytes(scheme.attention, kv_out, d)
            + matrix_bytes(scheme.attention, d, q_out))
    expert = 2 * matrix_bytes(scheme.experts, dims.f, d) + matrix_bytes(scheme.experts, d, dims.f)
    parts = {
        "attention": dims.layers * attn,
        "norms": 4 * d * (2 * dims.layers + 1),
        "router": dims.layers * matrix_bytes(scheme.router, dims.experts, d),
        "experts": dims.layers * dims.k * expert,
        "embedding_row": matrix_bytes(scheme.embedding, 1, d),
        "head": matrix_bytes(scheme.head, dims.vocab, d),
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes(dims: Dims, context: int, elem: int = 4) -> int:
    """Bytes of keys and values one token's attention reads at ``context`` positions."""
    return 2 * dims.layers * dims.kv_heads * dims.head_dim * context * elem


def read_bandwidth(threads: int, mbytes: int = 512, reps: int = 5) -> dict[str, float]:
    """This machine's streaming read rate with ``threads`` threads: the best of ``reps``
    sums of a float32 buffer of ``mbytes`` MB (much larger than any last-level cache; a
    sum is a pure read, one add per 4 bytes, far under what the cores can add)."""
    if mbytes < 64:
        raise ValueError(f"bandwidth buffer must be >= 64 MB to defeat the caches, got {mbytes}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(mbytes * 1024 * 1024 // 4, dtype=torch.float32)
        buf.sum()  # first touch: the pages are mapped before timing
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    nbytes = buf.numel() * 4
    return {"threads": threads, "buffer_mb": mbytes, "best_gb_s": round(nbytes / min(times) / 1e9, 2),
            "median_gb_s": round(nbytes / statistics.median(times) / 1e9, 2)}


def floor_ms(nbytes: int, gb_s: float) -> float:
    """Milliseconds to read ``nbytes`` at ``gb_s`` GB/s."""
    return 1e3 * nbytes / (gb_s * 1e9)
