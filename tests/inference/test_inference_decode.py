"""KV-cache generation: the same tokens as recomputing the whole sequence, for every model kind.

The models have random weights drawn at unit scale (embeddings std 1, every matrix std
1/sqrt(fan_in)) instead of GPT's small init, so logits have clear margins and greedy
decoding is not at the mercy of float rounding (batched vs one-row matmuls), while the
text still varies (a tiny init just repeats its input).
"""

from __future__ import annotations

import pytest
import torch

from moebit.inference.generate import dropless, eos_token_ids, generate, generate_tokens
from moebit.models.gpt import GPT, GPTConfig
from moebit.moe import TopKGate

PROMPTS = ["def foo(", "x", "", "import os\nimport sys\n" * 2]

KINDS = {
    "dense": {},
    "moe": {"num_experts": 8, "moe": {"num_experts_per_tok": 2}},
    "pr-moe": {"num_experts": [4, 8], "moe": {"num_experts_per_tok": 1, "residual": True}},
}


def sharp_model(kind: str, block_size: int = 64) -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=4, n_head=2, d_model=32, block_size=block_size, **KINDS[kind]))
    sharpen_(m)
    return m


@torch.no_grad()
def sharpen_(m: torch.nn.Module) -> None:
    for name, p in m.named_parameters():
        if name.startswith(("wte", "wpe")):
            p.normal_(0.0, 1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, p.shape[1] ** -0.5)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", list(KINDS))
def test_cache_matches_recompute_greedy(kind: str) -> None:
    m = sharp_model(kind)
    cached = generate(m, PROMPTS, max_new_tokens=16, temperature=0, batch_size=3)
    full = generate(m, PROMPTS, max_new_tokens=16, temperature=0, use_cache=False)
    assert cached == full
    assert all(len(t.encode("utf-8", errors="surrogateescape")) > 0 for t in cached)


def test_sampling_does_not_depend_on_batching() -> None:
    m = sharp_model("moe")
    one = generate(m, PROMPTS, max_new_tokens=12, temperature=1.0, top_k=20, seed=3, batch_size=1)
    four = generate(m, PROMPTS, max_new_tokens=12, temperature=1.0, top_k=20, seed=3, batch_size=4)
    other_seed = generate(m, PROMPTS, max_new_tokens=12, temperature=1.0, top_k=20, seed=4)
    assert one == four
    assert one != other_seed


def test_budgets_respect_block_size_and_stop() -> None:
    m = sharp_model("moe", block_size=32)
    long_prompt = [7] * 40  # cut to its last 31 bytes: room for one new token
    res = generate_tokens(m, [long_prompt, [1, 2, 3]], max_new_tokens=50, temperature=0)
    assert len(res.tokens[0]) == 1 and len(res.tokens[1]) == 29
    free = generate_tokens(m, [[1, 2, 3]], max_new_tokens=20, temperature=0).tokens[0]
    stop = bytes(free[4:6])
    first = next(i for i in range(1, len(free)) if bytes(free[i - 1:i + 1]) == stop)
    stopped = generate_tokens(m, [[1, 2, 3]], max_new_tokens=20, temperature=0, stop=stop).tokens[0]
    assert stopped == free[:first + 1]
    assert generate_tokens(m, [[1]], max_new_tokens=0).tokens == [[]]


def test_dropless_during_generation_and_restored() -> None:
    m = sharp_model("moe")
    gates = [g for g in m.modules() if isinstance(g, TopKGate)]
    assert all(g.config.drop_tokens for g in gates)  # the training default drops
    with dropless(m):
        assert not any(g.config.drop_tokens for g in gates)
        x = torch.randn(64, 32)
        r = gates[0](x)
        assert bool(r.kept_SK.all())
    assert all(g.config.drop_tokens for g in gates)
    # a 60-token prefill with capacity 1.0 would drop tokens; generation must not
    m.eval()
    ids = [list(range(40, 100))]
    res = generate_tokens(m, ids, max_new_tokens=1, temperature=0)
    with dropless(m):
        ref = int(m(torch.tensor(ids)).logits[0, -1].argmax())
    dropping = int(m(torch.tensor(ids)).logits[0, -1].argmax())
    assert res.tokens[0] == [ref]
    assert any(float(o.stats.fraction_dropped) > 0 for o in m(torch.tensor(ids)).ffn_outputs
               if hasattr(o, "stats"))
    del dropping


def test_bad_arguments() -> None:
    m = sharp_model("dense")
    with pytest.raises(ValueError, match="temperature"):
        generate(m, ["a"], temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        generate(m, ["a"], top_k=0)
    with pytest.raises(ValueError, match="batch_size"):
        generate(m, ["a"], batch_size=0)


def test_eos_ends_a_row_with_stop_keeping_the_token() -> None:
    """As transformers' generate: the EOS token is the row's last token; other rows go on."""
    m = sharp_model("dense")
    free = generate_tokens(m, [[1, 2, 3], [4, 5]], max_new_tokens=20, temperature=0, eos=[])
    assert free.finish_reasons == ["length", "length"]
    eos = free.tokens[0][5]
    k = free.tokens[0].index(eos)
    res = generate_tokens(m, [[1, 2, 3], [4, 5]], max_new_tokens=20, temperature=0, eos=[eos])
    assert res.tokens[0] == free.tokens[0][:k + 1] and res.finish_reasons[0] == "stop"
    other = free.tokens[1]
    if eos in other:
        assert res.tokens[1] == other[:other.index(eos) + 1]
    else:
        assert res.tokens[1] == other and res.finish_reasons[1] == "length"
    m.config.eos_token_id = eos  # a config's eos_token_id is the default, as in transformers
    try:
        assert generate_tokens(m, [[1, 2, 3]], max_new_tokens=20, temperature=0).tokens[0] == \
            res.tokens[0]
        recomputed = generate(m, [bytes([1, 2, 3]).decode()], max_new_tokens=20, temperature=0,
                              use_cache=False)[0]
        assert recomputed.encode("utf-8", errors="replace") == bytes(res.tokens[0])
    finally:
        del m.config.eos_token_id


def test_eos_token_ids_reads_config_and_generation_config(tmp_path) -> None:
    class Cfg:
        eos_token_id = 2

    assert eos_token_ids(Cfg()) == [2]
    assert eos_token_ids(GPTConfig()) == []  # byte models: no EOS byte
    assert eos_token_ids(Cfg(), tmp_path) == [2]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    assert eos_token_ids(Cfg(), tmp_path) == [7, 9]  # it wins, as in transformers
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(Cfg(), tmp_path)
