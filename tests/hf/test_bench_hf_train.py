"""The training breakdown of ``moebit bench hf``: parts timed inside one step add up."""

from __future__ import annotations

import torch
from hf_models import make_hf_model  # tests/hf/hf_models.py (skips without transformers)

from moebit.bench.hf_train import bf16_rows, train_rows
from moebit.hf import from_pretrained


def _timer_hooks(model: torch.nn.Module) -> int:
    hooks = [h for m in model.modules()
             for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    return sum("PartTimer" in getattr(h, "__qualname__", "") for h in hooks)


def test_breakdown_parts_lie_inside_the_step_and_leave_the_model_unhooked(tmp_path) -> None:
    hf = make_hf_model("mixtral", tmp_path).train()
    hf.config._experts_implementation = "grouped_mm"
    mb = from_pretrained(tmp_path).train()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    res = train_rows(hf, mb, ids, reps=1)
    for k in ("hf", "moebit"):
        total = res[f"{k}_fwd_bwd_ms"]
        assert res[f"{k}_attention_ms"] > 0 and res[f"{k}_moe_ms"] > 0, res
        assert res[f"{k}_rest_ms"] >= 0, res  # attention and MoE intervals are disjoint parts
        assert res[f"{k}_attention_ms"] + res[f"{k}_moe_ms"] <= total, res
        assert res[f"{k}_optimizer_ms"] > 0, res
    assert res["speedup_fwd_bwd"] > 0
    assert _timer_hooks(hf) == _timer_hooks(mb) == 0  # the timer's hooks are gone
    for m in (hf, mb):
        assert all(p.grad is None for p in m.parameters())
    out = mb(ids, ids)
    assert out.loss.requires_grad and torch.isfinite(out.loss)
    bf = bf16_rows(hf, mb, ids, reps=1)
    assert bf["hf_bf16_fwd_bwd_ms"] > 0 and bf["moebit_bf16_fwd_bwd_ms"] > 0
