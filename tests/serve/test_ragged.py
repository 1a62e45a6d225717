"""Ragged continuous batching and prefix caching: one packed forward per step gives the
same logits as a plain forward (GPT and an HF decoder), a request joining mid-decode gets
the text it gets alone, a shared prefix is prefilled once and changes no text, the token
budget splits a long prompt while decode rows advance every step, bad knobs are one line."""

from __future__ import annotations

import random

import pytest
import torch
from serve_helpers import request, run_engine, tiny_model

from moebit.cli import serve as serve_cli
from moebit.models.hf.config import HFDecoderConfig
from moebit.models.hf.decoder import HFDecoder
from moebit.models.tokenizer import ByteTokenizer
from moebit.serve.engine import Engine, check_knobs
from moebit.serve.prefix_cache import PrefixCache
from moebit.serve.ragged import RaggedView
from moebit.serve.slot_cache import SlotKVCache

pytestmark = pytest.mark.timeout(120)

MIXTRAL = dict(model_type="mixtral", vocab_size=256, hidden_size=32, intermediate_size=40,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2)
SYSTEM = b"You are a careful assistant. Answer in one line.\n"  # 50 bytes: 3 blocks of 16


def hf_model() -> HFDecoder:
    """A random Mixtral-style decoder (GQA: 4 query heads over 2 key/value heads), built
    from its config alone (no transformers needed), with 64 columns of context."""
    torch.manual_seed(0)
    model = HFDecoder(HFDecoderConfig.from_hf(MIXTRAL)).eval()
    with torch.no_grad():  # routers start at zero: give them a spread, so experts differ
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.3)
    model.config.block_size = 64
    return model


MODELS = {"gpt": lambda: tiny_model(num_experts=4, moe_every=1), "mixtral": hf_model}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_forward_matches_a_plain_forward(name: str) -> None:
    """Random packings of three sequences (one-token rows, chunks at column 0 and later,
    slots out of order) give each token the logits of one whole-sequence prefill."""
    torch.set_num_threads(1)
    model = MODELS[name]()
    rng = random.Random(0)
    seqs = [[rng.randrange(256) for _ in range(n)] for n in (19, 14, 23)]
    slots, pos = [2, 0, 3], [0, 0, 0]
    cache = SlotKVCache.for_model(model, slots=4, scratch=0)
    with torch.no_grad():
        # the reference: one prefill of the whole sequence into a plain KVCache (dropless
        # MoE, as every cached forward; a plain forward would drop over capacity)
        refs = [model(torch.tensor([s]), cache=model.new_cache(1, len(s))).logits[0]
                for s in seqs]
        while any(p < len(s) for p, s in zip(pos, seqs, strict=True)):
            plan = [(i, min(rng.choice([1, 1, 2, 5]), len(seqs[i]) - pos[i])) for i in range(3)
                    if pos[i] < len(seqs[i]) and rng.random() < 0.8]
            if not plan:
                continue
            ids = [t for i, n in plan for t in seqs[i][pos[i]:pos[i] + n]]
            view = RaggedView(cache, [(slots[i], n) for i, n in plan])
            logits = model(torch.tensor([ids]), cache=view).logits[0]
            at = 0
            for i, n in plan:
                torch.testing.assert_close(logits[at:at + n], refs[i][pos[i]:pos[i] + n],
                                           atol=1e-5, rtol=1e-4)
                at, pos[i] = at + n, pos[i] + n
    assert cache.lengths == [14, 0, 19, 23]


def _alone(model, prompt: bytes, n: int, **kw) -> list[int]:
    eng = Engine(model, ByteTokenizer(), max_batch=1, max_queue=4, **kw)
    r, _ = request("alone", prompt, max_tokens=n, temperature=0)
    run_engine(eng, [r])
    return r.out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_request_joining_mid_decode_gets_its_text_alone(name: str) -> None:
    torch.set_num_threads(1)
    model = MODELS[name]()
    target = b"def join(a, b):\n    return"
    want = _alone(model, target, 10)
    eng = Engine(model, ByteTokenizer(), max_batch=4, max_queue=8, max_batch_tokens=8)
    others = [request(f"o{i}", b"noise " * (i + 2), max_tokens=20, temperature=0)[0]
              for i in range(3)]
    for r in others:
        eng.submit(r)
    while not all(len(r.out) >= 2 for r in others):
        eng.step()
    late, _ = request("late", target, max_tokens=10, temperature=0)
    run_engine(eng, [late])  # its prompt is prefilled in chunks while the others decode
    assert late.out == want and len(want) == 10
    assert [r.out for r in others] == [_alone(model, b"noise " * (i + 2), 20) for i in range(3)]


def test_a_shared_prefix_is_prefilled_once_and_changes_no_text() -> None:
    torch.set_num_threads(1)
    model = tiny_model(block_size=128)
    prompts = [SYSTEM + q for q in (b"Q: 2+2?", b"Q: capital of France?", b"Q: why?")]

    def serve(prefix_tokens: int) -> tuple[Engine, list[list[int]]]:
        eng = Engine(model, ByteTokenizer(), max_batch=2, max_queue=8, max_batch_tokens=32,
                     prefix_cache_tokens=prefix_tokens)
        reqs = [request(str(i), p, max_tokens=6, temperature=0)[0] for i, p in enumerate(prompts)]
        run_engine(eng, reqs[:1])  # the first request fills the cache
        run_engine(eng, reqs[1:])
        return eng, [r.out for r in reqs]

    plain, want = serve(0)
    cached, got = serve(256)
    assert got == want
    total = sum(len(p) for p in prompts)
    assert plain.metrics.prompt_tokens == total
    # the system prompt's 3 full blocks (48 tokens) are copied, not prefilled, twice over
    assert cached.prefix.hits == 2 and cached.prefix.tokens_reused == 2 * 48
    assert cached.metrics.prompt_tokens == total - 2 * 48
    text = cached.metrics.render()
    assert "moebit_prefix_cache_hits_total 2\n" in text
    assert "moebit_prefix_cache_tokens_reused_total 96\n" in text
    assert "moebit_prefix_cache_lookups_total 3\n" in text
    assert "moebit_prefix_cache" not in plain.metrics.render()


def test_the_prefix_cache_is_bounded_and_evicts_chain_ends_first() -> None:
    """Four blocks at most: a second prompt's two blocks push out the first prompt's deepest
    block (its leaf), never its root; a prompt with a different first block shares none."""
    torch.set_num_threads(1)
    model = tiny_model()
    cache = SlotKVCache.for_model(model, slots=1, scratch=0)
    pc = PrefixCache(max_tokens=64, block=16)
    a, b = list(range(49)), [7] * 16 + list(range(17))
    for ids in (a, b):
        cache.reset(0)
        with torch.no_grad():
            model(torch.tensor([ids]), cache=RaggedView(cache, [(0, len(ids))]))
        pc.store(cache, 0, ids, pc.block_keys(ids), len(ids))
    assert pc.tokens == 64  # a's 3 blocks + b's 2 = 5 > 4: one went
    assert pc.load(cache, 0, a, pc.block_keys(a)) == 32  # a's root and second block remain
    assert pc.load(cache, 0, b, pc.block_keys(b)) == 32
    assert pc.load(cache, 0, [1] + a, pc.block_keys([1] + a)) == 0
    assert (pc.lookups, pc.hits, pc.tokens_reused) == (3, 2, 64)


def test_the_budget_splits_a_long_prompt_and_decode_rows_advance_every_step() -> None:
    torch.set_num_threads(1)
    model = tiny_model()
    eng = Engine(model, ByteTokenizer(), max_batch=3, max_queue=8, max_batch_tokens=8)
    widths: list[int] = []
    real = model.forward

    def counted(ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return real(ids, *args, **kwargs)

    model.forward = counted
    runners = [request(f"r{i}", b"ab", max_tokens=30, temperature=0)[0] for i in range(2)]
    for r in runners:
        eng.submit(r)
    eng.step()  # both prompts in one forward: their first tokens
    long, _ = request("long", b"x" * 40, max_tokens=2, temperature=0)
    eng.submit(long)
    steps = 0
    while not long.out:
        before = [len(r.out) for r in runners]
        eng.step()
        steps += 1
        assert [len(r.out) for r in runners] == [n + 1 for n in before]  # never starved
    del model.forward
    assert steps == 7  # 40 prompt tokens at 8 - 2 decode rows = 6 per step
    assert widths == [4] + [8] * 6 + [6]  # one forward per step, within the budget
    assert long.prefilled == 40 and eng.steps == 8


def test_bad_knobs_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for kw, msg in (({"max_batch_tokens": 0}, "--max-batch-tokens must be >= 1, got 0"),
                    ({"max_batch_tokens": 4}, "--max-batch-tokens 4 must be >= --max-batch 8"),
                    ({"prefix_cache_tokens": -1}, "--prefix-cache-tokens must be >= 0"),
                    ({"engine": "paged"}, "--engine must be one of ragged, legacy")):
        args = {"max_batch_tokens": 256, "prefix_cache_tokens": 0, "engine": "ragged", **kw}
        with pytest.raises(ValueError, match="^" + msg):
            check_knobs(8, 16, 64, **args)
    assert serve_cli.main(["no/such/run", "--max-batch", "8", "--max-batch-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moebit serve: error: --max-batch-tokens 4")
    assert serve_cli.main(["no/such/run", "--prefix-cache-tokens", "-5"]) == 2
    assert "--prefix-cache-tokens must be >= 0 (0: off), got -5" in capsys.readouterr().err
