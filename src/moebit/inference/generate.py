"""Batched KV-cache generation for any ``CausalLM`` (moebit's GPTs, the Hugging Face
families), dense or MoE, on one rank or many.

    model = load_model("runs/a")                       # moebit.inference.loading: newest checkpoint of a run
    texts = generate(model, ["def ", "class "], max_new_tokens=64, temperature=0)

Decoding drives the model's own forward with a ``KVCache`` (``models.kv_cache``): the
prompts of a batch are left-padded to one width, the cache is allocated once per batch
([B, H, T_max, Dh] per block, written in place) and carries each row's padding and
whether it is still live, so every row gets its own positions and key mask, and the
blocks run their feed-forward (MoE ``infer``: dropless, no losses) only on real tokens of
live rows. Nothing here computes attention, a block or an MoE layer.

Routing never drops a token: ``MoE.infer`` routes every token, and ``dropless(model)``
turns every gate dropless for code that calls the model's training forward (the
validation loss, ``use_cache=False``): an expert's capacity is a training device; at
inference a dropped token is a wrong token.

Many ranks (``torch.distributed`` initialised, e.g. by ``moebit generate --nproc N``):
the prompts are split across ranks (data parallel) and the texts gathered back, so every
rank returns the full list. An expert-parallel model (built with ``ep_size > 1``) holds
E/ep experts per rank and its MoE layers exchange tokens over all-to-all inside every
forward, so all ranks must run the same number of forwards: each global step every rank
runs one (a prefill, a decode step, or an empty forward of a zero-row batch that only
serves its experts), and a one-int allreduce per step tells everyone whether any rank
still has work. A rank whose sequences are finished keeps serving until then (DeepSpeed
hangs there, #6634).

Tokens are drawn by ``moebit.inference.sampling`` (the sampler ``moebit serve`` uses too);
a row ends at ``max_new_tokens``, at the context's end, on a ``stop`` byte string, or on an
end-of-sequence token (``eos_token_ids``: a Hugging Face model's ``eos_token_id``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moebit.inference import fused_decode
from moebit.inference.fused_generate import greedy_steps, prefill
from moebit.inference.sampling import SamplingParams, sample_rows
from moebit.models.interface import CausalLM, device_of
from moebit.moe import TopKGate

NEWLINE = 10  # an empty prompt starts from a newline byte


# ----------------------------------------------------------------------------- routing


@contextmanager
def dropless(model: torch.nn.Module) -> Iterator[None]:
    """Every MoE gate of ``model`` routes every token while inside; settings restored after."""
    saved = [(g.config, g.config.drop_tokens) for g in model.modules() if isinstance(g, TopKGate)]
    for c, _ in saved:
        c.drop_tokens = False
    try:
        yield
    finally:
        for c, old in saved:
            c.drop_tokens = old


# ----------------------------------------------------------------------------- decoding


def idle_forward(model: CausalLM) -> None:
    """Serve this rank's experts for one step with no tokens of its own (expert parallel):
    the model's forward on a zero-row batch, whose MoE layers still join the all-to-all.
    ``generate`` (a rank with no prompts left) and ``moebit serve``'s follower ranks both
    run this one."""
    empty_01 = torch.zeros(0, 1, dtype=torch.long, device=device_of(model))
    model(empty_01, cache=model.new_cache(0, 1), logits_to_keep=1)


def _ids_of(value: Any) -> list[int]:
    """An ``eos_token_id`` as Hugging Face writes it (an int, a list of ints, or null)."""
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    ids = [value] if isinstance(value, int) else value
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    return list(ids)


def eos_token_ids(config: Any, folder: str | Path | None = None) -> list[int]:
    """The token ids that end a sequence, as transformers' ``generate`` takes them: the
    folder's ``generation_config.json`` ``eos_token_id`` when it sets one, else the model
    config's (``config.json``); each an int or a list. A moebit GPT (bytes) has none: a
    byte model ends on ``stop`` strings or length."""
    if folder is not None:
        gen_file = Path(folder) / "generation_config.json"
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{gen_file} is not valid JSON: {e}") from None
            if gen.get("eos_token_id") is not None:
                return _ids_of(gen["eos_token_id"])
    return _ids_of(getattr(config, "eos_token_id", None))


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens of each prompt, in prompt order (an EOS kept)
    finish_reasons: list[str] = field(default_factory=list)  # "stop" (EOS / stop) or "length"
    prefill_s: float = 0.0  # this rank's time in prefill forwards
    decode_s: float = 0.0  # this rank's time in decode forwards (sampling included)
    decode_steps: int = 0  # decode forwards this rank ran with live rows
    global_steps: int = 0  # forwards run in lockstep (expert parallel), idle ones included
    per_step_s: list[float] = field(default_factory=list)  # wall time of each decode step


class _BatchRun:
    """One mini-batch of prompts being decoded: left-padded ids, its cache, per-row state."""

    def __init__(self, model: CausalLM, prompts: list[list[int]], budgets: list[int],
                 gens: list[torch.Generator], stop: bytes | None, eos: frozenset[int]) -> None:
        dev = device_of(model)
        self.model, self.budgets, self.gens, self.stop = model, budgets, gens, stop
        self.prompts = prompts
        self.eos = eos
        tmax = max(len(p) for p in prompts)
        self.cache = model.new_cache(len(prompts), tmax + max(budgets),
                                     starts=[tmax - len(p) for p in prompts])
        ids = torch.zeros(len(prompts), tmax, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, tmax - len(p):] = torch.tensor(p, device=dev)
        self.ids_BT = ids  # the prompts, then the last token of each row
        self.new: list[list[int]] = [[] for _ in prompts]
        self.reasons = ["length"] * len(prompts)
        self.live = [b > 0 for b in budgets]
        for i, alive in enumerate(self.live):
            if not alive:
                self.cache.finish(i)
        self.prefilled = False
        self.stepwise = False  # the native greedy calls refused this batch: step in Python

    @property
    def done(self) -> bool:
        return not any(self.live)

    def step(self, params: SamplingParams) -> None:
        """One forward (the prefill, then one decode step each call) and one token per live row."""
        logits_BV = None if self.prefilled else prefill(self.model, self.cache, self.prompts)
        if logits_BV is None:
            logits_BV = self.model(self.ids_BT, cache=self.cache, logits_to_keep=1).logits[:, -1]
        self.prefilled = True
        # one generator per prompt: a prompt's text does not depend on its batch or rank
        nxt = sample_rows(logits_BV, [params] * len(self.gens), self.gens)
        for i, tok in enumerate(nxt):
            if not self.live[i]:
                continue
            self.new[i].append(tok)
            stopped = tok in self.eos or bool(
                self.stop and bytes(self.new[i][-len(self.stop):]) == self.stop)
            if stopped:
                self.reasons[i] = "stop"
            if stopped or len(self.new[i]) >= self.budgets[i]:
                self.live[i] = False
                self.cache.finish(i)
        self._feed_last()

    def _last(self) -> list[int]:
        """Each row's newest token (0 for a row with none), the next step's input."""
        return [r[-1] if r else 0 for r in self.new]

    def _feed_last(self) -> None:
        self.ids_BT = torch.tensor(self._last(), device=self.ids_BT.device)[:, None]

    def steps_natively(self) -> list[float] | None:
        """Up to ``CALL_STEPS`` steps in one native call (``fused_generate``), for greedy
        rows that only token ids can stop (no ``stop`` bytes): each step's seconds, or
        None where the native step cannot serve this batch (then ``step`` goes on, from
        the same state, and is not asked again)."""
        if self.stop or not self.prefilled or self.stepwise:
            return None
        left = [b - len(n) for b, n in zip(self.budgets, self.new, strict=True)]
        run = greedy_steps(self.model, self.cache, self._last(), left, self.eos)
        if run is None:
            self.stepwise = True
            return None
        for i, toks in enumerate(run.tokens):
            self.new[i] += toks
            if toks and toks[-1] in self.eos:
                self.reasons[i] = "stop"
        self.live = list(self.cache.live)
        self._feed_last()
        return run.step_s


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _any_rank_busy(busy: bool) -> bool:
    t = torch.tensor([1 if busy else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


@torch.no_grad()
def generate_tokens(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    batch_size: int = 32,
    stop: bytes | None = None,
    shard: bool | None = None,
    eos: Sequence[int] | None = None,
) -> GenerationResult:
    """Token-level generation; see ``generate``. Prompts are lists of token ids.

    ``eos``: token ids that end a row (kept as its last token, finish reason "stop"), as
    transformers' ``generate`` does; None: the model config's ``eos_token_id`` (none for
    a moebit GPT), ``[]``: never stop early. ``eos_token_ids(config, folder)`` also reads a
    Hugging Face folder's ``generation_config.json``.
    """
    params = _params(temperature, top_k)
    fused_decode.attach(model, auto=True)  # decode steps in one native call where the model allows
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos_set = frozenset(eos_token_ids(model.config) if eos is None else eos)
    bs = model.config.block_size
    ids_all = [list(p)[-(bs - 1):] or [NEWLINE] for p in prompts]
    budgets_all = [min(max_new_tokens, bs - len(p)) for p in ids_all]
    distributed = _is_distributed()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    if shard is None:
        shard = distributed
    mine = list(range(len(ids_all)))
    if shard and world > 1:
        per = -(-len(ids_all) // world)
        mine = mine[rank * per:(rank + 1) * per]
    runs = (
        _BatchRun(model, [ids_all[j] for j in chunk], [budgets_all[j] for j in chunk],
                  [torch.Generator().manual_seed(seed * 1_000_003 + j) for j in chunk], stop,
                  eos_set)
        for chunk in (mine[i:i + batch_size] for i in range(0, len(mine), batch_size))
    )
    res = GenerationResult(tokens=[])
    was_training = model.training
    model.eval()
    try:
        out = _decode(model, mine, runs, distributed and model.ep_groups is not None, params, res)
    finally:
        model.train(was_training)
    if shard and world > 1:
        gathered: list[dict[int, tuple[list[int], str]] | None] = [None] * world
        dist.all_gather_object(gathered, out)
        for g in gathered:
            out.update(g or {})
    res.tokens = [out[j][0] for j in range(len(ids_all))]
    res.finish_reasons = [out[j][1] for j in range(len(ids_all))]
    return res


def _params(temperature: float, top_k: int | None) -> SamplingParams:
    """``generate``'s two knobs as the sampler's parameters (one sampler for all decoding)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    return SamplingParams(temperature=float(temperature), top_k=top_k or 0)


def _decode(model: CausalLM, mine: list[int], runs: Iterator[_BatchRun], lockstep: bool,
            params: SamplingParams, res: GenerationResult) -> dict[int, tuple[list[int], str]]:
    """Decode the mini-batches one after another; each global step is one forward.

    ``lockstep`` (expert parallel across ranks): every rank runs a forward per step, an
    empty one when it has nothing left, until the allreduce says no rank is busy.
    Returns prompt index -> (its new tokens, its finish reason).
    """
    new: list[tuple[list[int], str]] = []  # ``mine``'s prompts, in order
    run: _BatchRun | None = None
    while True:
        while run is None or run.done:
            if run is not None:
                new += zip(run.new, run.reasons, strict=True)
            run = next(runs, None)
            if run is None:
                break
        busy = run is not None
        if not (_any_rank_busy(busy) if lockstep else busy):
            break
        if run is None:
            res.global_steps += 1
            idle_forward(model)
            continue
        t0 = time.perf_counter()
        prefilling = not run.prefilled
        steps_s = None if prefilling or lockstep or not params.greedy else run.steps_natively()
        if steps_s is None:
            run.step(params)
            steps_s = [time.perf_counter() - t0]
        res.global_steps += len(steps_s)
        if prefilling:
            res.prefill_s += steps_s[0]
        else:
            res.decode_s += sum(steps_s)
            res.decode_steps += len(steps_s)
            res.per_step_s += steps_s
    return dict(zip(mine, new, strict=True))


def generate(
    model: CausalLM,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    use_cache: bool = True,
    batch_size: int = 32,
    stop: str | None = None,
    shard: bool | None = None,
) -> list[str]:
    """Continue each prompt; returns the continuations (without the prompt), in order.

    For moebit's byte-level GPT (prompts and texts are UTF-8 bytes; use ``generate_tokens``
    for a Hugging Face model's token ids). ``temperature=0`` (or below 1e-5) is greedy.
    Sampling uses one generator per prompt (seeded from ``seed`` and the prompt's index),
    so a prompt's text does not depend on the batch it was decoded in, nor on the rank.
    ``batch_size`` prompts are decoded together; ``stop``: a row ends once its text ends
    with this string (kept in the output); a byte model has no end-of-sequence byte, so
    ``stop`` and ``max_new_tokens`` are what end a row.
    ``shard`` (default: whenever a process group of more than one rank is up): split the
    prompts across ranks and gather the texts; every rank must call with the same prompts.
    ``use_cache=False`` recomputes the whole sequence every step, one prompt at a time,
    through the model's own forward (slow: the reference the cache is tested against).
    """
    ids = [list(p.encode("utf-8")) for p in prompts]
    stop_b = stop.encode("utf-8") if stop else None
    if use_cache:
        toks = generate_tokens(model, ids, max_new_tokens, temperature, top_k, seed,
                               batch_size, stop_b, shard).tokens
    else:
        toks = _generate_recompute(model, ids, max_new_tokens, _params(temperature, top_k),
                                   seed, stop_b, frozenset(eos_token_ids(model.config)))
    return [bytes(t).decode("utf-8", errors="replace") for t in toks]


@torch.no_grad()
def _generate_recompute(model: CausalLM, prompts: list[list[int]], max_new_tokens: int,
                        params: SamplingParams, seed: int, stop: bytes | None,
                        eos: frozenset[int]) -> list[list[int]]:
    """No cache, no batching, no sharding: every rank runs every prompt the same way."""
    bs = model.config.block_size
    dev = device_of(model)
    was_training = model.training
    model.eval()
    outs = []
    try:
        with dropless(model):
            for j, p in enumerate(prompts):
                ids = list(p)[-(bs - 1):] or [NEWLINE]
                gen = torch.Generator().manual_seed(seed * 1_000_003 + j)
                new: list[int] = []
                for _ in range(min(max_new_tokens, bs - len(ids))):
                    idx = torch.tensor([ids + new], device=dev)
                    logits = model(idx).logits[:, -1]
                    new.append(sample_rows(logits, [params], [gen])[0])
                    if new[-1] in eos or (stop and bytes(new[-len(stop):]) == stop):
                        break
                outs.append(new)
    finally:
        model.train(was_training)
    return outs
