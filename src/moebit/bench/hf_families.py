"""The model families ``moebit bench hf --family`` builds: each one's transformers config at
the benchmark's size, in the family's own shape.

- ``mixtral`` (the default): d_model ``--d-model``, ``--heads`` heads with as many key/value
  heads, SwiGLU experts of width ``--d-ffn``, top-2.
- ``gpt_oss``: gpt-oss-20b's proportions at ``--d-model``: heads of 64 dimensions, 8 query
  heads per key/value head, experts as wide as the model, top-4, layers alternating a
  128-token sliding window and full attention (each with sinks), yarn RoPE, biased router
  and experts, the clamped SwiGLU. transformers runs its eager attention for it (gpt-oss
  does not support SDPA there: ``_supports_sdpa = False``) and grouped_mm experts.
"""

from __future__ import annotations

import argparse
from typing import Any

FAMILIES = ("mixtral", "gpt_oss")


def family_config(args: argparse.Namespace) -> tuple[str, dict[str, Any], str]:
    """(model_type, AutoConfig.for_model keyword arguments, attention implementation)."""
    common = dict(vocab_size=256, hidden_size=args.d_model, num_hidden_layers=args.layers,
                  num_local_experts=args.experts, max_position_embeddings=2048)
    if args.family == "gpt_oss":
        heads = max(args.d_model // 64, 8)
        return "gpt_oss", dict(common, intermediate_size=args.d_model, head_dim=64,
                               num_attention_heads=heads, num_key_value_heads=max(heads // 8, 1),
                               num_experts_per_tok=4, sliding_window=128), "eager"
    return "mixtral", dict(common, intermediate_size=args.d_ffn, num_attention_heads=args.heads,
                           num_key_value_heads=args.heads, num_experts_per_tok=2), "sdpa"


def spread_parameters(model: Any) -> None:
    """Routers start at zero in transformers: a realistic spread (and gpt-oss's biases)."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.02)
