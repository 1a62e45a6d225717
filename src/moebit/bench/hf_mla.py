"""The DeepSeek-V3 rows of ``moebit bench hf --family deepseek_v3``: a small model of the
family's own shape, its KV-cache bytes per token and decode at long context.

The model keeps DeepSeek-V3's structure at a size 2 CPU threads can time: multi-head
latent attention with a low-rank query (``q_lora_rank``), a ``kv_lora_rank`` latent
twice the non-rotary head width, rotary keys half of it, yarn RoPE with both mscales,
``noaux_tc`` routing (sigmoid, a random ``e_score_correction_bias``, 4 groups of which
the best 2 are kept, top-4 of 16 experts, ``routed_scaling_factor`` 2.5), one shared
expert and a dense first layer.

Rows added to the common ones (train step, decode at batch 1 and 16):

- ``*_kv_cache_bytes_per_token``: what each cache holds per token of one sequence, all
  layers: moebit's latent cache (``kv_lora_rank + qk_rope_head_dim`` per layer),
  transformers' cache after a forward (measured from its tensors), and the expanded
  per-head keys and values an unabsorbed cache would hold;
- ``*_decode_ms_ctx{L}``: ms per generated token at batch 1 after a prompt of L tokens
  (1k and 4k by default), moebit (absorbed form over the latent cache) against
  transformers (which re-expands every cached latent through ``kv_b_proj`` at every step).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from moebit.inference.generate import generate_tokens
from moebit.models.hf.mla import cache_bytes_per_token

SHAPE = dict(vocab_size=256, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192,
             kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
             n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
             n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
             max_position_embeddings=8192,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 2048})


def deepseek_model(folder: Path) -> Any:
    """A random transformers DeepSeek-V3 of ``SHAPE`` (grouped_mm experts, SDPA), saved."""
    import transformers  # optional peer: only this benchmark needs it

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("deepseek_v3", **SHAPE)
    cfg._experts_implementation = "grouped_mm"
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0, 0.02)  # routers start at zero: give them a realistic spread
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.01)
    model.save_pretrained(folder, max_shard_size="100MB")
    return model


def cache_rows(hf: Any, mb: Any) -> dict[str, int]:
    """Bytes per token of one sequence, all layers: moebit, transformers, expanded K/V."""
    c = mb.config
    ids = torch.randint(0, c.vocab_size, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = hf(ids, use_cache=True).cache
    hf_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                   for t in (layer.keys, layer.values) if t is not None) // ids.shape[1]
    elem = mb.wte.weight.element_size()
    return {"moebit_kv_cache_bytes_per_token": cache_bytes_per_token(mb.new_cache(1, 64)),
            "hf_kv_cache_bytes_per_token": hf_bytes,
            "expanded_kv_bytes_per_token": c.num_layers * c.num_heads * elem * (
                c.qk_nope_head_dim + c.head_dim + c.v_head_dim)}


class _StepClock:
    """A transformers logits processor that only stamps the time of each call: the gaps
    between calls are its per-token decode steps (no second, shorter ``generate`` to
    subtract, so the long prompt is prefilled once per rep)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def context_rows(hf: Any, mb: Any, contexts: list[int], new: int, reps: int) -> dict[str, float]:
    """ms per decoded token at batch 1 after a prompt of each length, interleaved rep by
    rep; each side's median per-step time (the steps after the prompt's prefill), and
    moebit's speed-up (> 1: moebit faster)."""
    from transformers import LogitsProcessorList

    out: dict[str, float] = {}
    for ctx in contexts:
        ids = torch.randint(0, 256, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        hf_s: list[float] = []
        mb_s: list[float] = []
        for _ in range(reps):
            clock = _StepClock()
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=new + 1, min_new_tokens=new + 1,
                        logits_processor=LogitsProcessorList([clock]))
            hf_s += [b - a for a, b in zip(clock.stamps[:-1], clock.stamps[1:], strict=True)]
            r = generate_tokens(mb, ids.tolist(), max_new_tokens=new + 1, temperature=0, eos=[])
            mb_s += list(r.per_step_s)
        h, m = 1e3 * statistics.median(hf_s), 1e3 * statistics.median(mb_s)
        out.update({f"hf_decode_ms_ctx{ctx}": round(h, 2), f"moebit_decode_ms_ctx{ctx}": round(m, 2),
                    f"moebit_speedup_ctx{ctx}": round(h / m, 2)})
    return out
