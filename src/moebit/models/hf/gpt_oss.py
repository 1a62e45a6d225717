"""gpt-oss (``gpt_oss``) in moebit's terms: its config.json keys and its checks.

What differs from the other families, all of it carried by ``HFDecoderConfig`` fields:
alternating ``sliding_attention`` / ``full_attention`` layers (``layer_types``,
``sliding_window``), a learned sink logit per head in every softmax (``attention_sinks``),
biases on q/k/v and o_proj, yarn RoPE, a biased router choosing the top-4 logits and
softmaxing over them, and experts with biases and the clamped SwiGLU (moebit.moe keys
``expert_bias``, ``swiglu_alpha``, ``swiglu_limit``, ``swiglu_up_shift``, ``router_bias``).
Every expert layer is MoE; there is no dense MLP.

transformers' defaults (``GptOssConfig``) fill the keys a config.json leaves out, and are
written back with it, so that moebit and transformers read one model from the folder.
"""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "gpt_oss"
LAYER_TYPES = ("sliding_attention", "full_attention")
# GptOssConfig's defaults for the keys moebit reads
DEFAULTS: dict[str, Any] = {
    "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
    "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001, "head_dim": 64,
}
DEFAULT_THETA = 150000.0
# transformers' rope_parameters when a gpt-oss config.json gives none
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
# quantization methods whose expert tensors moebit reads (moebit.models.hf.mxfp4)
QUANT_METHODS = ("mxfp4",)


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """The config.json with transformers' defaults for what it leaves out."""
    out = {**DEFAULTS, **hf}
    if not out.get("rope_scaling") and not out.get("rope_parameters"):
        out["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": hf.get("rope_theta", DEFAULT_THETA)}
    if out.get("layer_types") is None and out.get("num_hidden_layers") is not None:
        out["layer_types"] = [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(out["num_hidden_layers"])]
    return out


def check(hf: dict[str, Any]) -> None:
    """gpt-oss options moebit does not implement, or malformed ones: errors naming the key."""
    n = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"gpt_oss: layer_types must be a list of num_hidden_layers = {n} "
                         f"entries, got {types!r}")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"gpt_oss: layer_types {bad} are not supported (only {list(LAYER_TYPES)})")
    w = hf.get("sliding_window")
    if "sliding_attention" in types and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise ValueError(f"gpt_oss: sliding_window must be a positive int for its sliding_attention "
                         f"layers, got {w!r}")
    for key in ("swiglu_alpha", "swiglu_limit"):
        v = hf.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"gpt_oss: {key} must be a number > 0, got {v!r}")
    q = hf.get("quantization_config")
    if q is not None:
        method = q.get("quant_method") if isinstance(q, dict) else q
        if method not in QUANT_METHODS:
            raise ValueError(f"gpt_oss: quantization_config.quant_method {method!r} is not "
                             f"supported (only {list(QUANT_METHODS)}: dequantized at load)")


def fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``HFDecoderConfig`` fields of a gpt-oss config.json (after ``with_defaults``)."""
    n = int(hf["num_hidden_layers"])
    e = int(hf["num_local_experts"])
    k = int(hf["num_experts_per_tok"])
    if k > e:
        raise ValueError(f"gpt_oss: num_experts_per_tok = {k} is larger than num_local_experts = {e}")
    types = list(hf["layer_types"])
    return dict(
        moe_intermediate_size=int(hf["intermediate_size"]), num_experts=e, num_experts_per_tok=k,
        moe_layers=list(range(n)), norm_topk_prob=True,  # top-k logits, softmax over them
        layer_types=types,
        sliding_window=int(hf["sliding_window"]) if "sliding_attention" in types else None,
        attention_sinks=True, o_proj_bias=bool(hf["attention_bias"]),
        expert_bias=True, router_bias=True, swiglu_alpha=float(hf["swiglu_alpha"]),
        swiglu_limit=float(hf["swiglu_limit"]), swiglu_up_shift=1.0,
    )
