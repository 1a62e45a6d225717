"""Per-request sampling: top-p/top-k cut the distribution, seeds repeat, stop strings hold back."""

from __future__ import annotations

import pytest
import torch

from moebit.inference.sampling import SamplingParams, find_stop, sample


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
