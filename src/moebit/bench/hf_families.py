"""The model families ``moebit bench hf --family`` builds: each one's transformers config at
the benchmark's size, in the family's own shape.

- ``mixtral`` (the default): d_model ``--d-model``, ``--heads`` heads with as many key/value
  heads, SwiGLU experts of width ``--d-ffn``, top-2.
- ``gpt_oss``: gpt-oss-20b's proportions at ``--d-model``: heads of 64 dimensions, 8 query
  heads per key/value head, experts as wide as the model, top-4, layers alternating a
  128-token sliding window and full attention (each with sinks), yarn RoPE, biased router
  and experts, the clamped SwiGLU. transformers runs its eager attention for it (gpt-oss
  does not support SDPA there: ``_supports_sdpa = False``) and grouped_mm experts.
- ``glm4_moe``: GLM-4.5's proportions: heads of 64 dimensions (``--heads``, a quarter as
  many key/value heads), half of each head rotated, attention biases and q/k norms, a dense
  first layer (width 3 ``--d-ffn``), then ``noaux_tc`` routing (sigmoid scores with a
  selection bias, ``routed_scaling_factor`` 2.5) to top-4 experts of width ``--d-ffn``
  beside one shared expert.
- ``minimax_m2``: MiniMax-M2's: heads of 64 dimensions, a quarter as many key/value
  heads, q/k norms over all heads, half of each head rotated (``rotary_dim``), sigmoid
  routing with a selection bias to top-4 Mixtral-style experts of width ``--d-ffn``.
"""

from __future__ import annotations

import argparse
from typing import Any

FAMILIES = ("mixtral", "gpt_oss", "glm4_moe", "minimax_m2")


def family_config(args: argparse.Namespace) -> tuple[str, dict[str, Any], str]:
    """(model_type, AutoConfig.for_model keyword arguments, attention implementation)."""
    common = dict(vocab_size=256, hidden_size=args.d_model, num_hidden_layers=args.layers,
                  num_local_experts=args.experts, max_position_embeddings=2048)
    if args.family == "gpt_oss":
        heads = max(args.d_model // 64, 8)
        return "gpt_oss", dict(common, intermediate_size=args.d_model, head_dim=64,
                               num_attention_heads=heads, num_key_value_heads=max(heads // 8, 1),
                               num_experts_per_tok=4, sliding_window=128), "eager"
    if args.family in ("glm4_moe", "minimax_m2"):
        heads = dict(num_attention_heads=args.heads, num_key_value_heads=max(args.heads // 4, 1),
                     head_dim=64, num_experts_per_tok=4)
        if args.family == "glm4_moe":
            del common["num_local_experts"]
            return "glm4_moe", dict(common, **heads, n_routed_experts=args.experts,
                                    moe_intermediate_size=args.d_ffn,
                                    intermediate_size=3 * args.d_ffn, n_shared_experts=1,
                                    first_k_dense_replace=1, n_group=1, topk_group=1,
                                    routed_scaling_factor=2.5, attention_bias=True,
                                    use_qk_norm=True, partial_rotary_factor=0.5), "sdpa"
        return "minimax_m2", dict(common, **heads, intermediate_size=args.d_ffn,
                                  rotary_dim=32, use_qk_norm=True), "sdpa"
    return "mixtral", dict(common, intermediate_size=args.d_ffn, num_attention_heads=args.heads,
                           num_key_value_heads=args.heads, num_experts_per_tok=2), "sdpa"


def spread_parameters(model: Any) -> None:
    """Routers start at zero in transformers: a realistic spread (and gpt-oss's biases)."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.02)
        for n, b in model.named_buffers():  # GLM / MiniMax: the selection bias picks experts
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.01)
