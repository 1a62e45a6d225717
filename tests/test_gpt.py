import pytest
import torch

from moebit.models.gpt import GPT, GPTConfig


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16, **kw))


def test_shapes_and_loss():
    m = tiny()
    x = torch.randint(0, 256, (3, 16))
    out = m(x, torch.randint(0, 256, (3, 16)))
    assert out.logits.shape == (3, 16, 256)
    assert out.loss.ndim == 0 and out.loss > 0
    assert float(out.aux_loss) == 0.0
    # Untrained model ~ uniform over 256 bytes.
    assert abs(float(out.loss.detach()) - torch.log(torch.tensor(256.0))) < 0.3


def test_tied_embeddings():
    m = tiny()
    assert m.lm_head.weight is m.wte.weight


def test_causality_future_token_never_changes_earlier_logits():
    m = tiny()
    m.eval()
    x = torch.randint(0, 256, (1, 16))
    base = m(x).logits
    for t in (3, 9, 15):
        y = x.clone()
        y[0, t] = (y[0, t] + 7) % 256
        changed = m(y).logits
        torch.testing.assert_close(changed[0, :t], base[0, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(changed[0, t], base[0, t])


def test_kv_cache_matches_full_recompute():
    m = tiny()
    m.eval()
    x = torch.randint(0, 256, (2, 12))
    full = m(x).logits
    cache = m.new_cache(batch=2, max_len=12)
    parts = [m(x[:, :5], cache=cache).logits]
    for t in range(5, 12):
        parts.append(m(x[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_too_long_sequence_is_a_clear_error():
    m = tiny()
    with pytest.raises(ValueError, match="block_size 16"):
        m(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"d_model": 30}, "divisible by n_head"),
        ({"num_experts": [4, 8, 16]}, "MoE blocks"),
        ({"n_layer": 0}, "n_layer must be positive"),
    ],
)
def test_bad_config(kw, msg):
    base = {"n_layer": 2, "n_head": 4, "d_model": 32}
    base.update(kw)
    with pytest.raises(ValueError, match=msg):
        GPTConfig(**base)


def test_moe_layer_placement():
    cfg = GPTConfig(n_layer=6, n_head=2, d_model=32, num_experts=[4, 4, 8], moe_every=2)
    assert cfg.moe_layers() == [1, 3, 5]
    assert [cfg.experts_at(i) for i in range(6)] == [0, 4, 0, 4, 0, 8]


def test_feed_forward_is_swappable():
    class Doubler(torch.nn.Module):
        def forward(self, x):
            class Out:
                hidden = 2 * x
                aux_loss = torch.tensor(0.5)
            return Out()

    m = tiny()
    for b in m.blocks:
        b.ffn = Doubler()
    out = m(torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 8)))
    assert float(out.aux_loss) == pytest.approx(1.0)
