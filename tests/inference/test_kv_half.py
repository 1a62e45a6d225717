"""A float16 key/value cache (``--kv-cache float16``): the conversions, the native step
against the modules on the same cache, and serving."""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import engine_texts, make, prompts

from moebit.comm._native import supported_isas
from moebit.inference import _fused_c, fused_decode
from moebit.inference.generate import generate_tokens
from moebit.models.hf.config import HFDecoderConfig
from moebit.models.hf.decoder import HFDecoder
from moebit.models.kv_cache import set_kv_dtype


@pytest.mark.parametrize("isa", supported_isas())
def test_half_conversions_round_to_nearest_even_as_torch(isa: str) -> None:
    """float32 -> float16 bitwise as torch's ``.half()`` (ties to even, subnormals,
    overflow to inf), back to float32 exactly; NaN stays NaN."""
    lib = _fused_c.load(isa)
    torch.manual_seed(0)
    x = torch.cat([torch.randn(1000) * 10.0 ** torch.randint(-9, 6, (1000,)),
                   torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e9, -1e9, 6e-8, 3e-8,
                                 2.98e-8, 1e-12, float("inf"), float("-inf"),
                                 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])])  # ties
    h = torch.empty(x.numel(), dtype=torch.int16)
    lib.fd_to_half(x.data_ptr(), h.data_ptr(), x.numel())
    want = x.half().view(torch.int16)
    assert torch.equal(h, want), (isa, x[h != want][:5].tolist())
    back = torch.empty(x.numel())
    lib.fd_from_half(h.data_ptr(), back.data_ptr(), x.numel())
    assert torch.equal(back, want.view(torch.float16).float())
    nan = torch.tensor([float("nan")] * 3)
    hn = torch.empty(3, dtype=torch.int16)
    lib.fd_to_half(nan.data_ptr(), hn.data_ptr(), 3)
    assert hn.view(torch.float16).isnan().all()


@torch.no_grad()
@pytest.mark.parametrize(("bits", "a8"), [(None, False), (4, True)])
def test_native_step_on_a_half_cache_matches_the_modules(bits: int | None, a8: bool) -> None:
    """On a float16 cache the native step (prefill and decode) writes each key as the
    float16 of the key it writes in a float32 cache, and gives the modules' greedy text
    and logits (float activations) on that same kind of cache."""
    m = make("mixtral", bits, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=224)
    ps = prompts(3)
    fused = fused_decode.attach(m, int8_activations=a8)
    full = m.new_cache(1, 16)
    m(torch.tensor([ps[0]]), cache=full, logits_to_keep=1)
    set_kv_dtype(m, "float16")
    half = m.new_cache(1, 16)
    assert half.k[0].dtype == torch.float16 and fused.serves(half)
    steps = fused.steps
    m(torch.tensor([ps[0]]), cache=half, logits_to_keep=1)
    n = len(ps[0])
    # layer 0's keys come from the embeddings alone: the same floats, rounded once
    assert torch.equal(half.k[0][:, :, :n], full.k[0][:, :, :n].half())
    got = generate_tokens(m, ps, max_new_tokens=10, temperature=0, batch_size=3, eos=[])
    assert fused.steps > steps
    if not a8:
        fused_decode.detach(m)
        want = generate_tokens(m, ps, max_new_tokens=10, temperature=0, batch_size=3, eos=[])
        assert got.tokens == want.tokens
        fused_decode.attach(m)
        torch.testing.assert_close(one_token_at_a_time(m, ps[1], True),
                                   one_token_at_a_time(m, ps[1], False), atol=1e-4, rtol=1e-4)


def one_token_at_a_time(m, p: list[int], native: bool) -> torch.Tensor:
    """The last token's logits of ``p`` fed one token a step (the native step or the
    modules) into a fresh cache."""
    (fused_decode.attach if native else fused_decode.detach)(m)
    cache = m.new_cache(1, 16)
    for x in p:
        out = m(torch.tensor([[x]]), cache=cache).logits[0, -1]
    return out


def test_serving_on_a_half_cache_gives_the_modules_text() -> None:
    """The engine's slots and packed steps on float16 keys and values: the same greedy
    texts natively and through the modules (which widen what they read)."""
    m = make("mixtral", vocab_size=256)
    m.config.block_size = 64
    set_kv_dtype(m, "float16")
    ps = [b"def f(x):\n", b"class A:", b"import os\nimport", b"x = 1"]

    def serve(fused: bool) -> list[list[int]]:
        (fused_decode.attach if fused else fused_decode.detach)(m)
        return engine_texts(m, ps, [6 + 2 * i for i in range(len(ps))], max_batch_tokens=8)

    assert serve(True) == serve(False)


def test_kv_cache_dtype_is_checked() -> None:
    """An unknown dtype and a latent (MLA) cache are refused by name; None goes back to
    the weights' dtype."""
    m = make("mixtral")
    with pytest.raises(ValueError, match="bfloat8"):
        set_kv_dtype(m, "bfloat8")
    set_kv_dtype(m, "float16")
    set_kv_dtype(m, None)
    assert m.new_cache(1, 4).k[0].dtype == torch.float32
    mla = HFDecoder(HFDecoderConfig.from_hf(dict(
        model_type="deepseek_v3", vocab_size=96, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, intermediate_size=48, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=64, q_lora_rank=32)))
    with pytest.raises(ValueError, match="latent"):
        set_kv_dtype(mla, "float16")
