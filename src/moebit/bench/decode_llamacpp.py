"""llama.cpp as ``moebit bench decode``'s peer: the same weights as GGUF F32, Q8_0, Q4_0.

    peer = LlamaCppPeer(model, workdir, threads=2, n_ctx=200)
    runners = peer.runners(prompt_ids)   # {"llamacpp_F32": run, "llamacpp_Q8_0": ..., ...}
    step_s, tokens = runners["llamacpp_Q8_0"](128)

Each file is written from the loaded moebit model (``gguf_convert.write_gguf``) and opened
with llama-cpp-python (the optional ``llamacpp`` extra: ``pip install 'moebit[llamacpp]'``)
with the benchmark's threads for both prefill and decode. A run feeds the prompt's token
ids (no tokenizer in between), then takes the argmax of each step's logits, as moebit's
greedy decoding does, one ``Llama.eval`` of one token per step; the step time is the
median over the run's decode steps (the prefill not counted), like moebit's rows.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moebit.bench.gguf_convert import QTYPES, write_gguf

Runner = Callable[[int], tuple[float, list[int]]]


def available() -> str | None:
    """None when llama-cpp-python and gguf import; else why not (for skips and errors)."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return (f"the llama.cpp peer needs the 'llamacpp' extra (pip install "
                f"'moebit[llamacpp]'): {e}")
    return None


def open_llama(path: Path, threads: int, n_ctx: int) -> Any:
    """A llama-cpp-python ``Llama`` on ``path``, quiet, ``threads`` for prefill and decode."""
    from llama_cpp import Llama

    with contextlib.redirect_stderr(io.StringIO()):
        return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                     n_threads_batch=threads, logits_all=False, verbose=False, seed=0)


def last_logits(llm: Any) -> np.ndarray:
    """The logits of the last token evaluated, read from the context itself: in 0.3.36
    ``Llama.eval`` leaves ``Llama.scores`` unwritten unless ``logits_all``."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def greedy(llm: Any, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """(median decode step s, ``new`` greedy tokens) from a fresh context."""
    llm.reset()
    llm.eval(prompt)
    toks = [int(last_logits(llm).argmax())]
    steps = []
    for _ in range(new - 1):
        t0 = time.perf_counter()
        llm.eval([toks[-1]])
        toks.append(int(last_logits(llm).argmax()))
        steps.append(time.perf_counter() - t0)
    return (statistics.median(steps) if steps else 0.0), toks


class LlamaCppPeer:
    """The GGUF files of one model and a llama.cpp context on each."""

    def __init__(self, model: Any, workdir: Path, threads: int, n_ctx: int,
                 qtypes: tuple[str, ...] = QTYPES) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(why)
        workdir.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, Path] = {}
        self.sizes_mb: dict[str, float] = {}
        self.llms: dict[str, Any] = {}
        for q in qtypes:
            path = write_gguf(model, workdir / f"model-{q}.gguf", q)
            self.files[q], self.sizes_mb[q] = path, round(path.stat().st_size / 1e6, 2)
            self.llms[q] = open_llama(path, threads, n_ctx)

    def runners(self, prompt: list[int]) -> dict[str, Runner]:
        return {f"llamacpp_{q}": (lambda n, llm=llm: greedy(llm, prompt, n))
                for q, llm in self.llms.items()}

    def close(self) -> None:
        for llm in self.llms.values():
            with contextlib.suppress(Exception):
                llm.close()
        self.llms.clear()
