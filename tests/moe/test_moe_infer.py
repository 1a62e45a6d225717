"""``infer``: the MoE layers' inference call equals their training forward with dropless routing."""

from __future__ import annotations

import pytest
import torch

from moebit.moe import MoE, MoEConfig, ResidualMoE


def _layer(cls: type, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, capacity_factor=1.0,
                    eval_capacity_factor=1.0, **kw)
    return cls(16, cfg).eval()


@pytest.mark.parametrize("cls", [MoE, ResidualMoE])
@torch.no_grad()
def test_infer_equals_dropless_forward(cls: type) -> None:
    x_SD = torch.randn(40, 16)
    dropless = _layer(cls, drop_tokens=False)
    torch.testing.assert_close(dropless.infer(x_SD), dropless(x_SD).hidden, rtol=0, atol=0)
    # a layer that drops in forward (capacity 1.0 over 40 tokens) drops nothing in infer
    dropping = _layer(cls, drop_tokens=True)
    inner = dropping.moe if cls is ResidualMoE else dropping
    assert float(dropping(x_SD).stats.fraction_dropped) > 0
    torch.testing.assert_close(dropping.infer(x_SD), dropless.infer(x_SD), rtol=0, atol=0)
    inner.gate.config.drop_tokens = False
    torch.testing.assert_close(dropping.infer(x_SD), dropping(x_SD).hidden, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [MoE, ResidualMoE])
def test_infer_of_no_tokens_and_dtype(cls: type) -> None:
    layer = _layer(cls)
    with torch.no_grad():
        assert layer.infer(torch.zeros(0, 16)).shape == (0, 16)
        y = layer.to(torch.bfloat16).infer(torch.randn(5, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (5, 16)
