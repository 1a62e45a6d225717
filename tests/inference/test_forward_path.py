"""One forward path: the model's own forward with a KVCache equals its full forward.

Decoding calls ``GPT.forward(ids, cache=...)``; these tests hold it to the training
forward (dropless routing) token by token, for left-padded batches, finished rows and
the KVCache's own checks. The models are the sharp ones of test_inference_decode (unit
scale weights: clear margins, so routing does not flip on float rounding).
"""

from __future__ import annotations

import pytest
import torch

from moebit.inference.generate import dropless
from moebit.models.gpt import GPT
from moebit.models.kv_cache import KVCache

KINDS = ["dense", "moe", "pr-moe"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(kind: str) -> GPT:
    from test_inference_decode import sharp_model

    return sharp_model(kind).eval()


@torch.no_grad()
def _full_logits(m: GPT, ids: list[int]) -> torch.Tensor:
    with dropless(m):
        return m(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_decoding_equals_full_forward(kind: str) -> None:
    m = _model(kind)
    ids = list(b"def main(argv):\n    return 0\n")
    full = _full_logits(m, ids)
    cache = m.new_cache(batch=1, max_len=len(ids))
    parts = [m(torch.tensor([ids[:7]]), cache=cache).logits[0]]
    for t in range(7, len(ids)):
        parts.append(m(torch.tensor([[ids[t]]]), cache=cache, logits_to_keep=1).logits[0])
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-4)
    assert cache.filled == len(ids)
    # a chunk of several tokens after the prefill (an offset causal mask, no padding)
    cache = m.new_cache(batch=1, max_len=len(ids))
    a = m(torch.tensor([ids[:5]]), cache=cache).logits[0]
    b = m(torch.tensor([ids[5:12]]), cache=cache).logits[0]
    torch.testing.assert_close(torch.cat([a, b]), full[:12], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_padded_batch_equals_unpadded_rows(kind: str) -> None:
    m = _model(kind)
    rows = [list(b"import os\nimport sys"), list(b"x = "), list(b"class A:")]
    follow = [list(b"\nfor"), list(b"1 + 2"), list(b" pass")]  # fed one token per step
    steps = min(len(f) for f in follow)
    tmax = max(len(r) for r in rows)
    starts = [tmax - len(r) for r in rows]
    ids = torch.zeros(len(rows), tmax, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, starts[i]:] = torch.tensor(r)
    cache = m.new_cache(len(rows), tmax + steps, starts)
    batched = [m(ids, cache=cache, logits_to_keep=1).logits[:, -1]]
    for s in range(steps):
        nxt = torch.tensor([[f[s]] for f in follow])
        batched.append(m(nxt, cache=cache).logits[:, -1])
    for i, r in enumerate(rows):
        one = m.new_cache(1, len(r) + steps)  # the same row alone: no padding at all
        alone = [m(torch.tensor([r]), cache=one).logits[0, -1]]
        for s in range(steps):
            alone.append(m(torch.tensor([[follow[i][s]]]), cache=one).logits[0, -1])
        full = _full_logits(m, r + follow[i][:steps])[len(r) - 1:]
        for s in range(steps + 1):
            torch.testing.assert_close(batched[s][i], alone[s], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(batched[s][i], full[s], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_finished_rows_skip_the_feed_forward_and_change_nothing() -> None:
    m = _model("moe")
    ids = torch.tensor([list(b"abcdef"), list(b"ghijkl")])
    ref_cache = m.new_cache(2, 8)
    m(ids, cache=ref_cache)
    ref = m(torch.tensor([[1], [2]]), cache=ref_cache).logits[:, -1]
    cache = m.new_cache(2, 8)
    m(ids, cache=cache)
    cache.finish(0)
    assert cache.ffn_rows(1).tolist() == [1]  # only row 1's token reaches the experts
    got = m(torch.tensor([[1], [2]]), cache=cache).logits[:, -1]
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    # the prefill of a padded batch runs the feed-forward on real tokens only
    padded = m.new_cache(2, 8, starts=[2, 0])
    assert padded.ffn_rows(6).tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert m.new_cache(2, 8).ffn_rows(6) is None


def test_cache_mask_shapes() -> None:
    c = KVCache.allocate(1, 2, 1, 4, 6, starts=[0, 2])
    m = c.mask_for(3)
    assert m.shape == (2, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # row 1: columns 0, 1 are padding; a padding query sees only itself (no empty softmax row)
    assert m[1, 0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    plain = KVCache.allocate(1, 2, 1, 4, 6)
    assert plain.mask_for(3) is None  # nothing filled: plain causal attention
    plain.advance(3)
    assert plain.mask_for(1) is None  # one query sees every key
    assert plain.mask_for(2)[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    assert plain.positions(2).tolist() == [[3, 4], [3, 4]]
    assert c.positions(3).tolist() == [[0, 1, 2], [0, 0, 0]]


@torch.no_grad()
def test_clear_errors() -> None:
    m = _model("dense")
    cache = m.new_cache(1, 4)
    with pytest.raises(ValueError, match="KVCache holds 4 columns: 0 are filled, 5 more"):
        m(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    long_cache = m.new_cache(1, 80)
    with pytest.raises(ValueError, match="exceeds block_size 64"):
        m(torch.zeros(1, 65, dtype=torch.long), cache=long_cache)
    with pytest.raises(ValueError, match="logits_to_keep"):
        m(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), logits_to_keep=1)
    with pytest.raises(ValueError, match="row starts"):
        m.new_cache(2, 4, starts=[0])
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        m.new_cache(1, 4, starts=[4])
