"""Per-request sampling: top-p/top-k cut the distribution, seeds repeat, stop strings hold back."""

from __future__ import annotations

import pytest
import torch

from moebit.inference.sampling import SamplingParams, find_stop, sample, sample_rows


def test_top_p_and_top_k_keep_only_the_head() -> None:
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, -2.0])
    gen = torch.Generator().manual_seed(0)
    tiny_p = SamplingParams(temperature=1.0, top_p=0.01)
    assert {sample(logits, tiny_p, gen) for _ in range(50)} == {0}
    k2 = SamplingParams(temperature=5.0, top_k=2)
    assert {sample(logits, k2, gen) for _ in range(200)} == {0, 1}
    assert sample(logits, SamplingParams(temperature=0), gen) == 0


def test_same_seed_same_draws() -> None:
    logits = torch.randn(256)
    p = SamplingParams(temperature=1.0, seed=5)
    a, b = p.generator(), p.generator()
    assert [sample(logits, p, a) for _ in range(20)] == [sample(logits, p, b) for _ in range(20)]


def test_find_stop_and_hold_back() -> None:
    assert find_stop("abc\n\nrest", ["\n\n"]) == (3, 0)
    assert find_stop("abc\n", ["\n\n"]) == (None, 1)  # "\n" may begin the stop string
    assert find_stop("abc", ["\n\n", "END"]) == (None, 0)
    assert find_stop("xEN", ["END"]) == (None, 2)


@pytest.mark.parametrize(("field", "value"), [("temperature", -0.1), ("top_p", 0.0),
                                               ("max_tokens", 0), ("top_k", -2)])
def test_check_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value}).check()


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    """1e-40 used to divide the logits into inf and softmax them into NaN (a 503)."""
    logits = torch.tensor([0.5, 3.0, 2.9, -1.0])
    p = SamplingParams(temperature=temperature)
    p.check()
    assert p.greedy
    assert sample(logits, p, torch.Generator().manual_seed(0)) == 1


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-9])
def test_tiny_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    """1e-300 rounds to 0 in float32, which dropped every token (invalid multinomial)."""
    logits = torch.randn(256, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, top_p=top_p)
    p.check()
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, p, gen) for _ in range(20)} == {int(logits.argmax())}


def test_non_finite_logits_fall_back_to_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=1.0)
    assert sample(torch.tensor([0.0, float("nan"), 1.0]), p, gen) == 2
    assert sample(torch.tensor([0.0, float("inf"), 1.0]), p, gen) == 1


def test_sample_rows_is_sample_per_row_with_greedy_rows_batched() -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=t, top_k=k, seed=i)
              for i, (t, k) in enumerate([(0, 0), (1.0, 5), (0.7, 0), (1e-9, 0), (2.0, 3)])]
    got = sample_rows(logits, params, [p.generator() for p in params])
    want = [sample(row, p, p.generator()) for row, p in zip(logits, params, strict=True)]
    assert got == want
    assert got[0] == int(logits[0].argmax()) and got[3] == int(logits[3].argmax())


@pytest.mark.parametrize(("field", "value", "words"), [
    ("seed", 2**70, "seed must be an integer"), ("seed", -(2**63) - 1, "seed"),
    ("temperature", float("nan"), "finite number"), ("top_p", float("inf"), "finite number")])
def test_check_refuses_out_of_range_seeds_and_non_finite_numbers(field: str, value: float,
                                                                 words: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}.*{words}" if field == "temperature" else f"^{field}"):
        SamplingParams(**{field: value}).check()
    with pytest.raises(ValueError, match="^stop strings must be at most 256"):
        SamplingParams(stop=["x" * 257]).check()
    SamplingParams(stop=["x" * 256]).check()
    SamplingParams(seed=2**64 - 1).check()  # the ends of torch's seed range are fine
    SamplingParams(seed=-(2**63)).check()


def test_generate_and_serve_share_one_sampler_and_one_idle_forward() -> None:
    """One implementation per algorithm: decoding and the server's engine call the same
    sampler, the follower ranks the same idle forward, and nothing reaches into wte."""
    import inspect

    from moebit.inference import generate, sampling
    from moebit.serve import engine, server

    assert generate.sample_rows is sampling.sample_rows is engine.sample_rows
    assert server.idle_forward is generate.idle_forward
    for mod in (generate, engine, server):
        src = inspect.getsource(mod)
        assert "def _sample(" not in src and "def _idle_forward" not in src
        assert ".wte" not in src and "models.gpt" not in src
