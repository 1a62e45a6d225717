"""DeepSeek-V3 (``deepseek_v3``) and DeepSeek-V2 (``deepseek_v2``) config.json keys in
moebit's terms: multi-head latent attention (MLA, ``mla.py``) and their MoE routing.

Both families share the attention: queries through a low-rank ``q_a_proj`` /
``q_b_proj`` pair (or one ``q_proj`` when ``q_lora_rank`` is null), keys and values
through one compressed latent of ``kv_lora_rank`` plus one shared rotary key of
``qk_rope_head_dim``. They differ in routing:

- V3 (``noaux_tc``): sigmoid scores, the checkpoint's ``e_score_correction_bias`` for
  selection, group-limited top-k where a group scores its best two experts, weights
  renormalised (``norm_topk_prob``) and times ``routed_scaling_factor``;
- V2: softmax scores, top-k (``greedy``) or group-limited top-k where a group scores its
  best expert (``group_limited_greedy``), weights not renormalised, times
  ``routed_scaling_factor``.

Every layer from ``first_k_dense_replace`` on is MoE, with ``n_shared_experts`` plain
shared experts (one MLP ``moe_intermediate_size * n_shared_experts`` wide). transformers
computes no load-balancing loss for either, so neither does moebit. The switches
transformers does not read (``scoring_func``, ``topk_method`` on V3, ``moe_layer_freq``)
must hold the value its model hard-codes; anything else is an error naming the key.
"""

from __future__ import annotations

from typing import Any

MLA_FAMILIES = ("deepseek_v3", "deepseek_v2")
_V2_TOPK = ("greedy", "group_limited_greedy")
# transformers' values for keys a config.json may leave out (DeepseekV3Config / V2Config)
_DEFAULTS = {
    "deepseek_v3": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8,
                    "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "rope_interleave": True},
    "deepseek_v2": {"n_shared_experts": 2, "routed_scaling_factor": 1.0,
                    "first_k_dense_replace": 0, "topk_method": "greedy", "norm_topk_prob": False},
}


def with_defaults(hf: dict[str, Any], mt: str) -> dict[str, Any]:
    """``hf`` with transformers' defaults of the family filled in (written back on save,
    so every reader of the folder agrees)."""
    return {**_DEFAULTS.get(mt, {}), **hf}


def _need(hf: dict[str, Any], mt: str, key: str) -> Any:
    if hf.get(key) is None:
        raise ValueError(f"{mt} config.json has no {key!r}")
    return hf[key]


def _positive(hf: dict[str, Any], mt: str, key: str) -> int:
    v = _need(hf, mt, key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{mt}: {key} must be a positive integer, got {v!r}")
    return v


def check_deepseek(hf: dict[str, Any], mt: str) -> None:
    """The keys whose other values transformers' DeepSeek models do not implement."""
    v3 = mt == "deepseek_v3"
    fixed: dict[str, Any] = {"moe_layer_freq": 1, "scoring_func": "sigmoid" if v3 else "softmax"}
    if v3:
        fixed["topk_method"] = "noaux_tc"
    for key, want in fixed.items():
        if key in hf and hf[key] != want:
            raise ValueError(f"{mt}: {key} = {hf[key]!r} is not supported (only {want!r})")
    if not v3 and hf.get("topk_method", "greedy") not in _V2_TOPK:
        raise ValueError(f"{mt}: topk_method = {hf['topk_method']!r} is not supported "
                         f"(one of {_V2_TOPK})")
    if not v3 and hf.get("norm_topk_prob"):
        # transformers' V2 ignores it, DeepSeek's own code renormalises: two models
        raise ValueError(f"{mt}: norm_topk_prob = true is not supported (transformers' "
                         "DeepSeek-V2 does not renormalise the top-k weights)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{mt}: mlp_bias = true is not supported (MLP biases)")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method") if isinstance(
            hf["quantization_config"], dict) else hf["quantization_config"]
        raise ValueError(f"{mt}: quantization_config ({method!r}) is not supported: "
                         "dequantize the checkpoint first")


def mla_fields(hf: dict[str, Any], mt: str) -> dict[str, Any]:
    """The attention fields of ``HFDecoderConfig`` (empty for the other families)."""
    if mt not in MLA_FAMILIES:
        return {}
    q = hf.get("q_lora_rank")
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
        raise ValueError(f"{mt}: q_lora_rank must be a positive integer or null, got {q!r}")
    interleave = True if mt == "deepseek_v2" else hf.get("rope_interleave", True)
    if interleave not in (True, False):
        raise ValueError(f"{mt}: rope_interleave must be true or false, got {interleave!r}")
    return dict(q_lora_rank=q, kv_lora_rank=_positive(hf, mt, "kv_lora_rank"),
                qk_nope_head_dim=_positive(hf, mt, "qk_nope_head_dim"),
                v_head_dim=_positive(hf, mt, "v_head_dim"), rope_interleave=bool(interleave))


def deepseek_moe_fields(hf: dict[str, Any], mt: str, n_layers: int) -> dict[str, Any]:
    """The MoE fields of ``HFDecoderConfig`` for a DeepSeek config.json."""
    v3 = mt == "deepseek_v3"
    e = _positive(hf, mt, "n_routed_experts")
    k = _positive(hf, mt, "num_experts_per_tok")
    width = _positive(hf, mt, "moe_intermediate_size")
    first = int(hf.get("first_k_dense_replace") or 0)
    norm = bool(hf.get("norm_topk_prob", True)) if v3 else False
    if norm and k == 1:
        raise ValueError(f"{mt}: num_experts_per_tok = 1 with a renormalised top-k (every "
                         "weight 1) is not supported")
    grouped = v3 or hf.get("topk_method", "greedy") == "group_limited_greedy"
    n_group = int(hf.get("n_group") or 1) if grouped else 1
    topk_group = int(hf.get("topk_group") or n_group) if grouped else None
    return dict(
        moe_intermediate_size=width, num_experts=e, num_experts_per_tok=k,
        moe_layers=[i for i in range(n_layers) if i >= first], norm_topk_prob=norm,
        shared_expert_intermediate_size=width * int(hf.get("n_shared_experts") or 0),
        scoring_func="sigmoid" if v3 else "softmax", score_correction_bias=v3,
        n_group=n_group, topk_group=topk_group, group_score="top2_sum" if v3 else "max",
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
    )
