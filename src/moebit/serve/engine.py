"""The continuous-batching engine: a fixed set of KV-cache slots, one forward per step.

    engine = Engine(model, ByteTokenizer(), max_batch=8, max_queue=64, max_batch_tokens=256,
                    prefix_cache_tokens=4096)
    threading.Thread(target=engine.run, daemon=True).start()
    engine.submit(Request("r1", ids, SamplingParams(max_tokens=32), on_event))

Each step (one loop of ``run``):
  1. waiting requests take free slots (``max_batch`` of them), cancelled ones leave; with
     a prefix cache, a joining request's cached prompt prefix is copied into its slot
     (``serve.prefix_cache``) and only the rest is prefilled;
  2. one forward of a ragged batch (``serve.ragged``): one token of every slot whose
     prompt is in the cache, then the next prompt chunks, oldest request first, within
     ``max_batch_tokens`` tokens in all. Decode rows always go in, so a long prompt
     enters over several steps while the others keep decoding, and no step waits on a
     prefill forward of its own. Where the model decodes natively (``fused_decode``),
     a step that carries chunks runs its decode rows in one native call and the chunks
     in a second forward.
``engine="legacy"`` keeps the engine before ragged batching: a decode forward and a
prefill forward (chunks right-padded, ``prefill_chunk`` tokens per step) per step.
A request leaves its slot when it ends (an end-of-sequence token or a stop string:
"stop"; ``max_tokens`` or the context's end: "length"; a cancel); the slot serves the
next waiting request at the next step.

One request's failure is its own: an exception while sampling, decoding its text or
emitting its events ends that request with an "error" event (the API's 500) and frees
its slot; a forward that raises ends the requests of that forward. Only in lockstep
(expert parallel), where the other ranks cannot skip a forward, does a failed forward
fail the whole engine.

Expert parallel (``lockstep``): rank 0 holds every request and runs these forwards; the
other ranks hold no requests and run, each step, the same number of forwards on empty
batches, which still serve their experts in every MoE layer's all-to-all. ``lockstep(n)``
tells them n (0 when idle: a heartbeat; -1: stop).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moebit.inference import fused_decode
from moebit.inference.generate import dropless
from moebit.inference.sampling import SamplingParams, find_stop, sample_rows
from moebit.models.interface import CausalLM, device_of
from moebit.models.tokenizer import Tokenizer
from moebit.serve.metrics import Metrics
from moebit.serve.prefix_cache import PrefixCache
from moebit.serve.ragged import RaggedView, native_groups
from moebit.serve.slot_cache import SlotKVCache

ENGINES = ("ragged", "legacy")


class QueueFull(Exception):
    """The bounded queue holds ``max_queue`` requests: the caller should retry later."""


class EngineStopped(Exception):
    """The engine is draining or has failed: no new requests."""


class PromptTooLong(ValueError):
    """The prompt leaves no room in the context for one new token."""


@dataclass
class Event:
    text: str  # new text since the last event
    finish_reason: str | None = None  # stop, length, cancelled, error; None: more to come
    error: str | None = None
    status: int = 503  # with "error": 503 the engine failed, 500 this request alone did


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]  # called on the engine thread; must be thread-safe
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # set from any thread; the engine frees the slot next step
    slot: int = -1
    prefilled: int = 0  # prompt tokens in the cache
    out: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text already emitted
    last_t: float = 0.0
    gen: torch.Generator | None = None
    block_keys: list[bytes] = field(default_factory=list)  # the prefix cache's, per block

    @property
    def completion_tokens(self) -> int:
        return len(self.out)


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, max_batch: int = 8,
                 max_queue: int = 64, prefill_chunk: int = 64,
                 lockstep: Callable[[int], None] | None = None,
                 metrics: Metrics | None = None, eos: Sequence[int] = (), *,
                 max_batch_tokens: int = 256, prefix_cache_tokens: int = 0,
                 engine: str = "ragged") -> None:
        check_knobs(max_batch, max_queue, prefill_chunk, max_batch_tokens,
                    prefix_cache_tokens, engine)
        # the packed ragged step is opt-in (models/interface.py: supports_ragged)
        self.legacy = engine == "legacy" or not getattr(model, "supports_ragged", False)
        self.max_batch_tokens = max_batch_tokens
        self.prefix = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.model, self.tok = model.eval(), tokenizer
        # steps of decode tokens alone in one native call where the model allows
        fused_decode.attach(model, auto=True)
        self.block_size = model.config.block_size
        self.vocab_size = int(model.config.vocab_size)
        self.eos = frozenset(eos)  # token ids that end a request ("stop"), not part of its text
        self.device = device_of(model)
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        self.lockstep = lockstep
        self.metrics = metrics or Metrics()
        self.metrics.prefix_cache = self.prefix
        # padding columns past a slot's end: only the legacy engine's padded prefill has any
        self.cache = SlotKVCache.for_model(model, max_batch,
                                           scratch=prefill_chunk if self.legacy else 0)
        self.slots: list[Request | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.cv = threading.Condition()
        self.stopping = False  # drain: finish what is in, take nothing new
        self.failed: str | None = None
        self.on_failure: Callable[[], None] | None = None  # e.g. stop the HTTP server
        self.steps = 0

    # ------------------------------------------------------------------ other threads

    def submit(self, req: Request) -> None:
        """Queue a request; QueueFull / EngineStopped / PromptTooLong, or a ValueError whose
        first word is the bad field (an empty prompt, a token id outside the vocabulary,
        a bad sampling parameter): what the engine cannot run is refused here."""
        if len(req.prompt) >= self.block_size:
            raise PromptTooLong(f"prompt has {len(req.prompt)} tokens; the context holds "
                                f"{self.block_size}, so at most {self.block_size - 1}")
        if not req.prompt:
            raise ValueError("prompt is empty (this tokenizer has no BOS token to start from)")
        bad = [t for t in req.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt holds token id {bad[0]}, outside the model's vocabulary "
                             f"of {self.vocab_size}")
        req.params.check()
        gen = req.params.generator()
        if self.prefix is not None:  # hashed here, on the caller's thread
            req.block_keys = self.prefix.block_keys(req.prompt)
        with self.cv:
            if self.failed is not None or self.stopping:
                raise EngineStopped(self.failed or "the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                self.metrics.finished("rejected")
                raise QueueFull(f"the queue holds {self.max_queue} requests")
            req.gen = gen
            self.waiting.append(req)
            self.metrics.queue_depth = len(self.waiting)
            self.cv.notify()

    def stop(self) -> None:
        """Drain: requests in flight finish, then ``run`` returns."""
        with self.cv:
            self.stopping = True
            self.cv.notify()

    def busy(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    # ------------------------------------------------------------------ engine thread

    def run(self) -> None:
        """Step until stopped and drained; on a failure (a dead rank) fail every request."""
        try:
            with torch.no_grad(), dropless(self.model):
                while self._wait_for_work():
                    self.step()
            if self.lockstep is not None:
                self.lockstep(-1)
        except Exception as e:  # noqa: BLE001 - any failure ends every request with it
            self._fail(f"{type(e).__name__}: {e}")

    def _wait_for_work(self) -> bool:
        with self.cv:
            while not self.busy():
                if self.stopping:
                    return False
                self.cv.wait(timeout=1.0)
                if not self.busy() and self.lockstep is not None:
                    self.lockstep(0)  # heartbeat: the other ranks' collectives never time out
        return True

    def _fail(self, why: str) -> None:
        with self.cv:
            self.failed = why
            reqs = [r for r in self.slots if r is not None] + list(self.waiting)
            self.waiting.clear()
            self.slots = [None] * len(self.slots)
            self.metrics.queue_depth = self.metrics.running = 0
        for r in reqs:
            self._send(r, Event("", "error", why))
            self.metrics.finished("error")
        if self.on_failure is not None:
            self.on_failure()

    def step(self) -> None:
        joined = self._admit()
        if self.prefix is not None:
            for r in joined:
                r.prefilled = self.prefix.load(self.cache, r.slot, r.prompt, r.block_keys)
        decode = [r for r in self.slots if r is not None and r.prefilled == len(r.prompt)]
        if not self.legacy:
            plan = [(r, 1) for r in decode] + self._prefill_plan(self.max_batch_tokens - len(decode))
            if self.lockstep is not None:
                self.lockstep(int(bool(plan)))
            self.steps += 1
            if plan:
                self._guarded(self._ragged, plan, [r for r, _ in plan])
            return
        prefill = self._prefill_plan(self.prefill_chunk)
        if self.lockstep is not None:
            self.lockstep(int(bool(decode)) + int(bool(prefill)))
        self.steps += 1
        if decode:
            self._guarded(self._decode, decode, decode)
        if prefill:
            self._guarded(self._prefill, prefill, [r for r, _ in prefill])

    def _guarded(self, phase: Callable, arg: list, reqs: list[Request]) -> None:
        """Run one forward phase; if it raises, end its requests (their slots' caches are
        reset on leaving), not the engine: unless in lockstep, where the other ranks'
        forwards are already under way and the engine must fail."""
        try:
            phase(arg)
        except Exception as e:  # noqa: BLE001 - the requests of this forward get the error
            if self.lockstep is not None:
                raise
            for r in reqs:
                self._drop(r, f"{type(e).__name__}: {e}")

    def _drop(self, r: Request, why: str) -> None:
        """End one request with an error (500) and free its slot."""
        with self.cv:  # left before the client hears: /metrics agrees with the reply
            self._leave(r, "error")
        self._send(r, Event("", "error", why, status=500))

    def _send(self, r: Request, ev: Event) -> None:
        """Emit an event; a callback that raises (its client is gone) cancels the request."""
        try:
            r.emit(ev)
        except Exception:  # noqa: BLE001 - the client side failed: stop decoding for it
            r.cancelled = True
    def _admit(self) -> list[Request]:
        """Cancelled requests leave, waiting ones take free slots; those that joined."""
        joined = []
        with self.cv:
            for r in list(self.slots):
                if r is not None and r.cancelled:
                    self._leave(r, "cancelled")
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
                self.metrics.finished("cancelled")
            for i in range(len(self.slots)):
                if self.slots[i] is None and self.waiting:
                    r = self.waiting.popleft()
                    r.slot = i
                    self.slots[i] = r
                    self.cache.reset(i)
                    joined.append(r)
            self.metrics.queue_depth = len(self.waiting)
            self.metrics.running = sum(s is not None for s in self.slots)
        return joined

    def _prefill_plan(self, budget: int) -> list[tuple[Request, int]]:
        """(request, tokens of its prompt to prefill now), oldest first, within the budget."""
        plan = []
        for r in sorted((r for r in self.slots if r is not None and r.prefilled < len(r.prompt)),
                        key=lambda r: r.arrival):
            n = min(len(r.prompt) - r.prefilled, budget)
            if n <= 0:
                break
            plan.append((r, n))
            budget -= n
        return plan

    def _ragged(self, plan: list[tuple[Request, int]]) -> None:
        """One forward of the packed batch; where the model steps natively
        (``fused_decode``), one native call per ``MAX_ROWS`` tokens instead: decode rows
        first, prompt chunks after them, a chunk cut where a call is full (its rest goes
        in the next call, which starts where this one's prefill ended)."""
        if getattr(self.model, "decode_step", None) is None:
            self._packed(plan)
            return
        for group in native_groups(plan, fused_decode.MAX_ROWS):
            self._packed(group)

    def _packed(self, plan: list[tuple[Request, int]]) -> None:
        """One forward of a packed batch: a decode row is its last token, a prefill chunk
        its next n prompt tokens; logits only where a token is sampled (every decode row,
        and each chunk that ends its prompt)."""
        ids: list[int] = []
        keep, ends = [], []
        for r, n in plan:
            if r.prefilled == len(r.prompt):
                ids.append(r.out[-1])
            else:
                ids += r.prompt[r.prefilled:r.prefilled + n]
            if r.prefilled + n >= len(r.prompt):
                keep.append(r)
                ends.append(len(ids) - 1)
        dev = self.device
        view = RaggedView(self.cache, [(r.slot, n) for r, n in plan])
        logits_KV = self.model(torch.tensor([ids], device=dev), cache=view,
                               logits_to_keep=torch.tensor(ends, dtype=torch.long,
                                                             device=dev)).logits[0]
        for r, n in plan:
            if r.prefilled < len(r.prompt):
                r.prefilled += n
                self.metrics.prompt_tokens += n
                self._remember(r, n)
        if keep:
            self._sample_all(keep, logits_KV.float().cpu())

    def _remember(self, r: Request, n: int) -> None:
        """Offer the prefix cache the prompt blocks this request's last n tokens finished."""
        pc = self.prefix
        if pc is not None and r.prefilled // pc.block > (r.prefilled - n) // pc.block:
            pc.store(self.cache, r.slot, r.prompt, r.block_keys, r.prefilled)

    def _decode(self, reqs: list[Request]) -> None:
        """One token for each of ``reqs``, in one forward over slots 0 .. the highest one
        decoding: contiguous slots let the cache hand attention a view of its buffers,
        not a gathered copy. The other slots in that range ride along with no real
        token (nothing advances, no feed-forward; their scribble is overwritten later)."""
        dev = self.device
        hi = max(r.slot for r in reqs) + 1
        last, real = [0] * hi, [0] * hi
        for r in reqs:
            last[r.slot], real[r.slot] = r.out[-1], 1
        self.cache.bind(range(hi), real)
        logits_SV = self.model(torch.tensor(last, device=dev)[:, None], cache=self.cache,
                               logits_to_keep=1).logits[:, -1]
        rows = torch.tensor([r.slot for r in reqs], device=dev)
        self._sample_all(reqs, logits_SV.index_select(0, rows).float().cpu())

    def _prefill(self, plan: list[tuple[Request, int]]) -> None:
        dev = self.device
        t = max(n for _, n in plan)
        ids_RT = torch.zeros(len(plan), t, dtype=torch.long)
        for i, (r, n) in enumerate(plan):
            ids_RT[i, :n] = torch.tensor(r.prompt[r.prefilled:r.prefilled + n])
        self.cache.bind([r.slot for r, _ in plan], [n for _, n in plan])
        logits_RTV = self.model(ids_RT.to(dev), cache=self.cache).logits
        done = []
        for i, (r, n) in enumerate(plan):
            r.prefilled += n
            self._remember(r, n)
            if r.prefilled == len(r.prompt):
                done.append((r, logits_RTV[i, n - 1]))
        self.metrics.prompt_tokens += sum(n for _, n in plan)
        if done:
            self._sample_all([r for r, _ in done],
                             torch.stack([lg for _, lg in done]).float().cpu())

    def _sample_all(self, reqs: list[Request], logits_RV: torch.Tensor) -> None:
        """A token for each request: the greedy rows in one batched argmax, the others one
        by one with their own generators; a request whose sampling raises fails alone."""
        now = time.monotonic()
        live = [i for i, r in enumerate(reqs) if not r.cancelled]
        greedy = [i for i in live if reqs[i].params.greedy]
        best = (dict(zip(greedy, logits_RV[greedy].float().argmax(-1).tolist(), strict=True))
                if greedy else {})
        for i in live:
            r = reqs[i]
            try:
                assert r.gen is not None
                r.out += ([best[i]] if i in best
                          else sample_rows(logits_RV[i][None], [r.params], [r.gen]))
                if len(r.out) == 1:
                    self.metrics.ttft.observe(now - r.arrival)
                else:
                    self.metrics.itl.observe(now - r.last_t)
                r.last_t = now
                self._emit(r)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._drop(r, f"{type(e).__name__}: {e}")
        self.metrics.tokens_out(len(reqs))

    def _emit(self, r: Request) -> None:
        """Send the request's new text; end it on an end-of-sequence token (not part of the
        text, counted in ``completion_tokens``), a stop string, max_tokens or the context."""
        eos = r.out[-1] in self.eos
        text = self.tok.decode(r.out[:-1] if eos else r.out)
        at, hold = find_stop(text, r.params.stop)
        reason = None
        if at is not None:
            text, reason = text[:at], "stop"
        elif eos:
            reason = "stop"
        elif len(r.out) >= r.params.max_tokens or len(r.prompt) + len(r.out) >= self.block_size:
            reason = "length"
        if reason is None:
            end = len(text) - hold
            while end > r.sent and text[end - 1] == "\ufffd":  # maybe a multi-byte char's start
                end -= 1
            if end > r.sent:
                self._send(r, Event(text[r.sent:end]))
                r.sent = end
            return
        with self.cv:  # left before the client hears: /metrics agrees with the reply
            self._leave(r, reason)
        self._send(r, Event(text[r.sent:], reason))
        r.sent = len(text)

    def _leave(self, r: Request, reason: str) -> None:
        """Free the request's slot (the caller holds ``cv``)."""
        if r.slot >= 0 and self.slots[r.slot] is r:
            self.slots[r.slot] = None
            self.cache.reset(r.slot)
            self.metrics.finished(reason)
            self.metrics.running = sum(s is not None for s in self.slots)
        self.cv.notify()


def check_knobs(max_batch: int, max_queue: int, prefill_chunk: int, max_batch_tokens: int,
                prefix_cache_tokens: int, engine: str) -> None:
    """The engine's settings, each bad one a one-line ValueError naming its flag."""
    for name, v in (("max-batch", max_batch), ("max-queue", max_queue),
                    ("prefill-chunk", prefill_chunk), ("max-batch-tokens", max_batch_tokens)):
        if v < 1:
            raise ValueError(f"--{name} must be >= 1, got {v}")
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "ragged" and max_batch_tokens < max_batch:
        raise ValueError(f"--max-batch-tokens {max_batch_tokens} must be >= --max-batch "
                         f"{max_batch}: every decoding request takes one token of each step's "
                         "budget, and a joining prompt needs what is left")
    if prefix_cache_tokens < 0:
        raise ValueError(f"--prefix-cache-tokens must be >= 0 (0: off), got {prefix_cache_tokens}")
