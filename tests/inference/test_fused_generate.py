"""``generate`` in native calls (``moebit.inference.fused_generate``). Greedy decoding in
one call against the step-by-step loop it replaces: the same tokens, finish reasons and
step counts, with left padding, rows that stop on an EOS or at different budgets, 8-bit
activations, and a NaN logit; and the cases that must keep the Python loop. The native
prefill (float and 8-bit activations): the native step's arithmetic, close to the
modules', cut into calls, the serving engine's text."""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import SHAPES, engine_texts, make, prompts

from moebit.inference import fused_decode, fused_generate
from moebit.inference import generate as gen_mod
from moebit.inference.generate import generate_tokens


def stepwise(monkeypatch: pytest.MonkeyPatch, m, ps, **kw):
    """``generate_tokens`` with the one-call path refused: one native step per call."""
    with monkeypatch.context() as mp:
        mp.setattr(gen_mod, "greedy_steps", lambda *a: None)
        return generate_tokens(m, ps, temperature=0, **kw)


def counted(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every ``greedy_steps`` result ``generate`` gets (None: it stepped in Python)."""
    seen: list[object] = []

    def spy(*a):
        seen.append(fused_generate.greedy_steps(*a))
        return seen[-1]

    monkeypatch.setattr(gen_mod, "greedy_steps", spy)
    return seen


@pytest.mark.parametrize("bits, a8", [(None, False), (8, True), (4, True)])
def test_one_call_gives_the_step_by_step_tokens(monkeypatch: pytest.MonkeyPatch,
                                                bits: int | None, a8: bool) -> None:
    m = make("mixtral", bits, **(SHAPES["quads"] if a8 else {}))
    fused = fused_decode.attach(m, int8_activations=a8)
    assert fused is not None, m.decode_step_reason
    ps = prompts(3)  # left padding: rows of 5, 8 and 11 tokens
    ref = stepwise(monkeypatch, m, ps, max_new_tokens=12, batch_size=3, eos=[])
    seen = counted(monkeypatch)
    before = fused.steps
    got = generate_tokens(m, ps, max_new_tokens=12, temperature=0, batch_size=3, eos=[])
    assert got.tokens == ref.tokens and got.finish_reasons == ref.finish_reasons
    assert len(seen) == 1 and seen[0] is not None  # every step after the prefill in one call
    assert fused.steps - before == got.decode_steps == ref.decode_steps == 11
    assert len(got.per_step_s) == 11 and all(s > 0 for s in got.per_step_s)


def test_a_long_generation_runs_in_calls_of_call_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """11 steps in calls of at most 4 (4 + 4 + 3): Python regains control between calls
    (a Ctrl-C, a serving thread waiting for the lock), and the text is the same."""
    m = make("mixtral", 8)
    fused_decode.attach(m)
    ps = prompts(2)
    ref = stepwise(monkeypatch, m, ps, max_new_tokens=12, batch_size=2, eos=[])
    monkeypatch.setattr(fused_generate, "CALL_STEPS", 4)
    seen = counted(monkeypatch)
    got = generate_tokens(m, ps, max_new_tokens=12, temperature=0, batch_size=2, eos=[])
    assert got.tokens == ref.tokens and got.decode_steps == 11
    assert [len(r.step_s) for r in seen] == [4, 4, 3]


def test_rows_stop_on_eos_and_at_their_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 1's third token is made an EOS, and the block size clips the longest prompt's
    budget, so the rows stop at three different steps."""
    m = make("mixtral", 4, max_position_embeddings=20)
    m.config.block_size = 20
    fused_decode.attach(m)
    ps = prompts(3)
    free = stepwise(monkeypatch, m, ps, max_new_tokens=12, batch_size=3, eos=[])
    eos = [free.tokens[1][2]]
    ref = stepwise(monkeypatch, m, ps, max_new_tokens=12, batch_size=3, eos=eos)
    seen = counted(monkeypatch)
    got = generate_tokens(m, ps, max_new_tokens=12, temperature=0, batch_size=3, eos=eos)
    assert seen and seen[0] is not None
    assert got.tokens == ref.tokens and got.finish_reasons == ref.finish_reasons
    assert got.decode_steps == ref.decode_steps
    assert ref.finish_reasons[1] == "stop" and len(ref.tokens[1]) <= 3
    assert len({len(t) for t in ref.tokens}) > 1, [len(t) for t in ref.tokens]


def test_a_nan_logit_is_taken_as_torch_argmax_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's argmax counts a NaN as the maximum (the first one); so does the C loop."""
    m = make("mixtral")
    with torch.no_grad():
        m.lm_head.weight[7] = float("nan")
    fused_decode.attach(m)
    ps = prompts(2)
    ref = stepwise(monkeypatch, m, ps, max_new_tokens=5, batch_size=2, eos=[])
    got = generate_tokens(m, ps, max_new_tokens=5, temperature=0, batch_size=2, eos=[])
    assert got.tokens == ref.tokens == [[7] * 5, [7] * 5]


def test_sampling_stop_bytes_and_the_module_path_step_in_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = make("mixtral", 8)
    fused_decode.attach(m)
    seen = counted(monkeypatch)
    generate_tokens(m, prompts(2), max_new_tokens=4, temperature=0.8, batch_size=2, eos=[])
    generate_tokens(m, prompts(2), max_new_tokens=4, temperature=0, batch_size=2, eos=[],
                    stop=b"\x00\x01")
    assert seen == []  # not asked: sampled rows, and stop bytes need the text each step
    fused_decode.detach(m)
    out = generate_tokens(m, prompts(2), max_new_tokens=4, temperature=0, batch_size=2, eos=[])
    assert seen == [None] and out.decode_steps == 3  # no native step: Python steps


@torch.no_grad()
def test_greedy_steps_leaves_the_cache_as_the_loop_does() -> None:
    """Called by hand after a prefill: the cache advances by the steps run, and every
    row ends finished; a call it cannot serve is refused with None, the cache untouched."""
    m = make("mixtral")
    fused_decode.attach(m)
    cache = m.new_cache(2, 12, starts=[0, 2])
    m(torch.tensor([[1, 2, 3, 4], [0, 0, 5, 6]]), cache=cache, logits_to_keep=1)
    run = fused_generate.greedy_steps(m, cache, [4, 6], [5, 3], [])
    assert [len(t) for t in run.tokens] == [5, 3] and len(run.step_s) == 5
    assert cache.filled == 9 and cache.live == [False, False]
    assert fused_generate.greedy_steps(m, cache, [1, 1], [0, 0], []) is None  # nothing live
    fresh = m.new_cache(1, 6)
    m(torch.tensor([[1, 2, 3, 4]]), cache=fresh, logits_to_keep=1)
    assert fused_generate.greedy_steps(m, fresh, [4], [3], []) is None  # past its capacity
    with torch.enable_grad():  # the native step serves no autograd
        assert fused_generate.greedy_steps(m, fresh, [4], [2], []) is None
    assert fresh.filled == 4 and fresh.live == [True]


def module_prefill(m, ps: list[list[int]]):
    """The modules' prefill of left-padded ``ps``: (last-token logits [B, V], cache)."""
    t = max(map(len, ps))
    cache = m.new_cache(len(ps), t + 2, starts=[t - len(p) for p in ps])
    ids = torch.zeros(len(ps), t, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, t - len(p):] = torch.tensor(p)
    step, m.decode_step = m.decode_step, None
    try:
        return m(ids, cache=cache, logits_to_keep=1).logits[:, -1], cache
    finally:
        m.decode_step = step


@torch.no_grad()
@pytest.mark.parametrize(("bits", "a8"), [(None, False), (8, False), (4, True), (8, True)])
def test_prefill_is_the_native_steps_arithmetic(
        monkeypatch: pytest.MonkeyPatch, bits: int | None, a8: bool) -> None:
    """Rows of 5, 8, 11 and 30 tokens, left-padded, in calls of at most 16 tokens (pieces
    of one row in order, calls that mix rows): each row's logits and keys are exactly
    those of the native step fed its prompt one token a call, close to the modules' (to
    float rounding with float activations), and the padding columns hold zeros."""
    monkeypatch.setattr(fused_generate, "MAX_ROWS", 16)
    m = make("mixtral", bits, **SHAPES["quads"])
    fused_decode.attach(m, int8_activations=a8)
    ps = [*prompts(3), list(range(30))]
    ref, _ = module_prefill(m, ps)
    t = max(map(len, ps))
    cache = m.new_cache(len(ps), t + 2, starts=[t - len(p) for p in ps])
    cache.k[0].fill_(float("nan"))  # stale memory where the padding is
    got = fused_generate.prefill(m, cache, ps)
    assert cache.filled == t
    for i, p in enumerate(ps):
        alone = m.new_cache(1, t + 2)
        for x in p:  # one native step per token
            one = m(torch.tensor([[x]]), cache=alone).logits[0, -1]
        torch.testing.assert_close(got[i], one, atol=0, rtol=0)
        s = cache.starts[i]
        torch.testing.assert_close(cache.k[1][i, :, s:t], alone.k[1][0, :, :len(p)], atol=0, rtol=0)
        assert not cache.k[0][i, :, :s].any() and not cache.v[1][i, :, :s].any()
    rel = (got - ref).norm() / ref.norm()
    if a8:
        assert 0 < rel < 0.06  # rounded activations: close to the modules, not equal
    else:
        assert rel < 1e-5  # the same arithmetic, sums in another order


@torch.no_grad()
def test_prefill_keeps_the_modules_where_it_does_not_apply() -> None:
    m = make("mixtral", 8)
    fused_decode.detach(m)  # no native step: the modules prefill
    cache = m.new_cache(1, 8)
    assert fused_generate.prefill(m, cache, [[1, 2, 3]]) is None and cache.filled == 0
    a8 = make("mixtral", 8, **SHAPES["quads"])
    fused_decode.attach(a8, int8_activations=True)
    cache = a8.new_cache(2, 8, starts=[0, 1])
    assert fused_generate.prefill(a8, cache, [[1, 2, 3], [4, 5, 6]]) is None  # starts wrong
    assert fused_generate.prefill(a8, a8.new_cache(1, 2), [[1, 2, 3]]) is None  # too long
    with torch.enable_grad():
        assert fused_generate.prefill(a8, a8.new_cache(1, 8), [[1, 2, 3]]) is None
    with pytest.raises(IndexError, match="outside the vocabulary"):
        fused_generate.prefill(a8, a8.new_cache(1, 8), [[1, 2, 999]])


@pytest.mark.parametrize(("bits", "a8"), [(None, False), (4, False), (4, True), (8, True)])
def test_generate_writes_the_serving_engines_text(bits: int | None, a8: bool) -> None:
    """The engine prefills prompt chunks natively and ``generate`` does too, so a prompt
    gets the same greedy text from both, with float or 8-bit activations."""
    m = make("mixtral", bits, **SHAPES["quads"])
    fused_decode.attach(m, int8_activations=a8)
    ps = prompts(3)
    got = generate_tokens(m, ps, max_new_tokens=8, temperature=0, batch_size=3, eos=[])
    assert engine_texts(m, ps, [8] * len(ps), max_batch_tokens=64) == got.tokens
