"""The continuous-batching engine without HTTP: same tokens as moebit generate, seeded
requests independent of their batch, chunked prefill, slots freed and reused, a failing
request or forward ending only its own requests, EOS, what submit refuses."""

from __future__ import annotations

import pytest
import torch
from serve_helpers import MOE, request, run_engine, tiny_model

from moebit.inference.generate import generate_tokens
from moebit.inference.sampling import SamplingParams
from moebit.models.tokenizer import ByteTokenizer
from moebit.serve.engine import Engine, QueueFull, Request
from moebit.serve.slot_cache import SlotKVCache

PROMPTS = [b"def foo(", b"x", b"import os\nimport sys\n" * 2, b"class A:\n    "]


def test_slot_cache_matches_full_forward() -> None:
    """Prefill in uneven chunks of two slots in one forward, then decode: the logits equal
    the model's plain causal forward over the whole sequence."""
    torch.set_num_threads(1)
    model = tiny_model()
    seqs = [list(b"hello world, again"), list(b"abc")]
    cache = SlotKVCache.for_model(model, slots=3, scratch=8)
    got: list[list[torch.Tensor]] = [[], []]
    pos = [0, 0]
    slots = [2, 0]
    with torch.no_grad():
        while any(p < len(s) for p, s in zip(pos, seqs, strict=True)):
            plan = [(i, min(7, len(seqs[i]) - pos[i])) for i in range(2) if pos[i] < len(seqs[i])]
            t = max(n for _, n in plan)
            ids = torch.zeros(len(plan), t, dtype=torch.long)
            for j, (i, n) in enumerate(plan):
                ids[j, :n] = torch.tensor(seqs[i][pos[i]:pos[i] + n])
            cache.bind([slots[i] for i, _ in plan], [n for _, n in plan])
            logits = model(ids, cache=cache).logits
            for j, (i, n) in enumerate(plan):
                got[i] += list(logits[j, :n])
                pos[i] += n
        for i, s in enumerate(seqs):
            ref = model(torch.tensor([s])).logits[0]
            torch.testing.assert_close(torch.stack(got[i]), ref, atol=1e-5, rtol=1e-4)


def _engine_tokens(model, prompts, max_batch, chunk, engine="ragged", **params) -> list[str]:
    """The texts of ``prompts`` served together; ``chunk``: the prompt tokens per step (the
    legacy engine's prefill chunk, the ragged engine's whole step budget)."""
    eng = Engine(model, ByteTokenizer(), max_batch=max_batch, max_queue=64, prefill_chunk=chunk,
                 max_batch_tokens=max(chunk, max_batch), engine=engine)
    pairs = [request(str(i), p, **params) for i, p in enumerate(prompts)]
    run_engine(eng, [r for r, _ in pairs])
    assert all(c.done.is_set() for _, c in pairs)
    return [c.text for _, c in pairs]


def test_greedy_equals_generate_tokens_dense_and_moe() -> None:
    torch.set_num_threads(1)
    for over in ({}, {k: v for k, v in MOE.items() if k in ("num_experts", "moe_every")}):
        model = tiny_model(**over)
        ref = generate_tokens(model, [list(p) for p in PROMPTS], max_new_tokens=12,
                              temperature=0, batch_size=4).tokens
        want = [bytes(t).decode("utf-8", errors="replace") for t in ref]
        for engine, max_batch, chunk in (("ragged", 4, 64), ("ragged", 2, 5), ("ragged", 1, 3),
                                         ("legacy", 4, 64), ("legacy", 2, 5)):
            assert _engine_tokens(model, PROMPTS, max_batch, chunk, engine, max_tokens=12,
                                  temperature=0) == want, (over, engine, max_batch, chunk)


def test_seeded_request_same_text_whatever_the_batch() -> None:
    torch.set_num_threads(1)
    model = tiny_model()
    params = {"max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234}
    alone = _engine_tokens(model, [b"seeded"], 1, 64, **params)[0]
    eng = Engine(model, ByteTokenizer(), max_batch=4, max_queue=64, prefill_chunk=4)
    others = [request(f"o{i}", b"noise " * (i + 1), max_tokens=5 + 3 * i, temperature=1.3,
                      seed=i) for i in range(6)]
    target, got = request("t", b"seeded", **params)
    for r, _ in others[:3]:
        eng.submit(r)
    eng.step()
    eng.step()  # the target joins a batch already decoding
    run_engine(eng, [target] + [r for r, _ in others[3:]])
    assert got.text == alone
    assert len(alone) > 0


def test_stop_string_and_length_and_context_end() -> None:
    torch.set_num_threads(1)
    model = tiny_model()
    full = _engine_tokens(model, [b"ab"], 1, 64, max_tokens=30, temperature=0)[0]
    stop = full[5:7]
    eng = Engine(model, ByteTokenizer(), max_batch=2, max_queue=4)
    r1, c1 = request("a", b"ab", max_tokens=30, temperature=0, stop=[stop])
    r2, c2 = request("b", b"z" * 60, max_tokens=30, temperature=0)  # 4 tokens to the context end
    run_engine(eng, [r1, r2])
    assert c1.text == full[:full.index(stop)] and c1.events[-1].finish_reason == "stop"
    assert len(r2.out) == 4 and c2.events[-1].finish_reason == "length"
    assert eng.slots == [None, None]


def test_cancel_frees_the_slot_for_the_next_request() -> None:
    torch.set_num_threads(1)
    eng = Engine(tiny_model(), ByteTokenizer(), max_batch=1, max_queue=4)
    r1, c1 = request("a", b"ab", max_tokens=50, temperature=0)
    r2, c2 = request("b", b"cd", max_tokens=3, temperature=0)
    eng.submit(r1)
    eng.submit(r2)
    for _ in range(3):
        eng.step()
    assert eng.slots[0] is r1 and list(eng.waiting) == [r2]
    r1.cancelled = True
    while eng.busy():
        eng.step()
    assert c2.done.is_set() and not c1.done.is_set()
    assert eng.metrics.requests == {"cancelled": 1, "length": 1}


class _FailsOnTwoTokens(ByteTokenizer):
    """A tokenizer whose decode raises on a two-token text: a request fault mid-decode."""

    def decode(self, ids: list[int]) -> str:
        if len(ids) == 2:
            raise RuntimeError("decode fault")
        return super().decode(ids)


def test_a_failing_request_ends_alone_and_the_engine_keeps_serving() -> None:
    torch.set_num_threads(1)
    eng = Engine(tiny_model(), _FailsOnTwoTokens(), max_batch=4, max_queue=8)
    (bad, cb), (ok, co) = request("bad", b"ab", max_tokens=5, temperature=0), \
        request("ok", b"cd", max_tokens=1, temperature=0)
    run_engine(eng, [bad, ok])
    assert cb.events[-1].finish_reason == "error" and cb.events[-1].status == 500
    assert "decode fault" in cb.events[-1].error
    assert co.events[-1].finish_reason == "length"
    assert eng.failed is None and eng.slots == [None] * 4
    later, cl = request("later", b"ef", max_tokens=1, temperature=0)
    run_engine(eng, [later])
    assert cl.events[-1].finish_reason == "length"
    assert eng.metrics.requests == {"error": 1, "length": 2}
    assert eng.metrics.running == 0  # the gauge follows requests out, not only in


def test_a_failing_forward_ends_its_requests_not_the_engine() -> None:
    torch.set_num_threads(1)
    model = tiny_model()
    eng = Engine(model, ByteTokenizer(), max_batch=2, max_queue=8)
    real, calls = model.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("forward fault")
        return real(*args, **kwargs)

    model.forward = flaky
    r1, c1 = request("a", b"ab", max_tokens=3, temperature=0)
    run_engine(eng, [r1])
    assert c1.events[-1].finish_reason == "error" and "forward fault" in c1.events[-1].error
    r2, c2 = request("b", b"ab", max_tokens=3, temperature=0)
    run_engine(eng, [r2])
    del model.forward
    assert c2.text == _engine_tokens(model, [b"ab"], 1, 64, max_tokens=3, temperature=0)[0]
    assert eng.failed is None


def test_eos_token_ends_the_request_with_stop_and_is_not_text() -> None:
    torch.set_num_threads(1)
    model = tiny_model()
    ids = generate_tokens(model, [list(b"ab")], max_new_tokens=30, temperature=0).tokens[0]
    eos = ids[6]
    k = ids.index(eos)
    eng = Engine(model, ByteTokenizer(), max_batch=2, max_queue=4, eos=[eos, 255])
    r, c = request("a", b"ab", max_tokens=30, temperature=0)
    run_engine(eng, [r])
    assert c.events[-1].finish_reason == "stop"
    assert c.text == bytes(ids[:k]).decode("utf-8", errors="replace")
    assert r.completion_tokens == k + 1  # the EOS token is counted, as OpenAI counts it


def test_submit_refuses_what_the_engine_cannot_run_and_counts_rejections() -> None:
    eng = Engine(tiny_model(), ByteTokenizer(), max_batch=1, max_queue=1)
    with pytest.raises(ValueError, match="^prompt is empty"):
        eng.submit(request("e", b"")[0])
    with pytest.raises(ValueError, match="^prompt holds token id 300"):
        eng.submit(Request("v", [1, 300], SamplingParams(), lambda ev: None))
    with pytest.raises(ValueError, match="^seed"):
        eng.submit(request("s", b"a", seed=2**70)[0])
    eng.submit(request("q", b"a")[0])
    with pytest.raises(QueueFull):
        eng.submit(request("r", b"a")[0])
    assert eng.metrics.requests == {"rejected": 1}
