"""`HFDecoderConfig`: one Hugging Face MoE (or dense sibling) ``config.json`` in moebit's terms.

The families differ in a handful of switches (where the experts' width is stored,
whether the router renormalises its top-k weights, q/k norms per head or over the whole
projection, a gated shared expert, which layers are dense, norms before or after each
sublayer; GLM-4.5 MoE and MiniMax-M2: sigmoid routing with a fixed selection bias,
partial RoPE); everything else is the same RMSNorm/RoPE/GQA decoder. The dense families
(Llama, Qwen2, Qwen3, OLMo2) are that decoder with no MoE layer. A key this mapping does
not understand, and a value moebit does not implement (sliding windows, an unknown RoPE
type, another activation), is an error naming it: a checkpoint never silently means something else.

    cfg = HFDecoderConfig.from_hf(json.load(open("model/config.json")), ep_size=2)
    cfg.to_hf()        # the config.json to write back (the original keys, dtype updated)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moebit.models.hf import gpt_oss
from moebit.models.hf.deepseek import (
    MLA_FAMILIES,
    check_deepseek,
    deepseek_moe_fields,
    mla_fields,
    with_defaults,
)
from moebit.models.rope import ROPE_TYPES, RopeSpec, parse_rope

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "glm4_moe",
            "minimax_m2", "gpt_oss") + MLA_FAMILIES
# dense siblings of the MoE families, loaded as the same decoder with no MoE layer (and
# the sources of ``moebit upcycle HF_DIR``); attention as in their MoE family
DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "olmo2")
# families whose norms follow each sublayer (OLMo2's reordered norms), not precede it
_POST_NORM = ("olmo2", "flex_olmo")
# transformers' rope_theta when a config.json gives none (its `default_theta`)
_DEFAULT_THETA = {"mixtral": 1e6, "flex_olmo": 5e5, "minimax_m2": 5e6, "gpt_oss": gpt_oss.DEFAULT_THETA}
# families whose attention rotates part of each head (and transformers' default share)
_PARTIAL_ROTARY = {"glm4_moe": 0.5, "minimax_m2": 1.0}
# families routing with sigmoid scores and a checkpoint's e_score_correction_bias
_SIGMOID_ROUTED = ("glm4_moe", "minimax_m2")
# transformers' values for GLM-4.5 MoE keys a config.json may leave out (Glm4MoeConfig)
_GLM4_MOE_DEFAULTS = {"first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1,
                      "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True}
QK_NORMS = ("none", "head", "full")
# model types with a known reason they do not load (named in the error); none at present
_UNSUPPORTED: dict[str, str] = {}


@dataclass
class HFDecoderConfig:
    """The decoder moebit builds; ``hf`` keeps the source config.json for saving back."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense layers' SwiGLU width
    moe_intermediate_size: int  # each routed expert's width
    num_experts: int
    num_experts_per_tok: int
    moe_layers: list[int]
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated / GLM's plain one (0: none)
    scoring_func: str = "softmax"  # "sigmoid": GLM-4.5 MoE, MiniMax-M2
    score_correction_bias: bool = False  # the checkpoint's e_score_correction_bias [E]
    n_group: int = 1  # group-limited top-k (GLM-4.5 MoE, DeepSeek)
    topk_group: int | None = None
    group_score: str = "top2_sum"  # "max": DeepSeek-V2's group_limited_greedy
    routed_scaling_factor: float = 1.0
    partial_rotary_factor: float = 1.0  # share of head_dim that rotates (GLM, MiniMax)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_params: dict[str, Any] = field(default_factory=dict)  # the type's other parameters
    max_position_embeddings: int = 4096
    block_size: int = 0  # sequence length moebit trains / decodes at; 0: max_position_embeddings
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2-MoE's qkv_bias)
    qk_norm: str = "none"  # "head" (Qwen3: RMSNorm over head_dim), "full" (OLMoE: over H*Dh)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    post_norm: bool = False  # OLMo2/FlexOlmo: x + norm(attn(x)), x + norm(mlp(x)); no input norm
    attention_dropout: float = 0.0
    router_aux_loss_coef: float = 0.01
    # gpt-oss (models/hf/gpt_oss.py): per-layer attention kinds, sinks, more biases, its SwiGLU
    layer_types: list[str] = field(default_factory=list)  # empty: every layer full attention
    sliding_window: int | None = None  # the window of the "sliding_attention" layers
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator
    o_proj_bias: bool = False
    expert_bias: bool = False  # gate_up_proj_bias / down_proj_bias
    router_bias: bool = False
    swiglu_alpha: float = 1.0  # the experts' clamped SwiGLU (moebit.moe.glu); 1/None/0: plain
    swiglu_limit: float | None = None
    swiglu_up_shift: float = 0.0
    # multi-head latent attention (DeepSeek-V3/V2, models/hf/mla.py; kv_lora_rank 0: none);
    # head_dim is then qk_rope_head_dim, the rotated width
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    ep_size: int = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hf: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES + DENSE_FAMILIES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; "
                             f"supported: {FAMILIES + DENSE_FAMILIES}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if not self.block_size:
            self.block_size = self.max_position_embeddings
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"moe_layers {bad} are outside the {self.num_layers} layers")
        if self.moe_layers and self.num_experts % self.ep_size:
            raise ValueError(f"num_experts = {self.num_experts} is not divisible by "
                             f"ep_size = {self.ep_size}")

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def shared_expert_gated(self) -> bool:
        """Qwen2-MoE scales its shared expert by a per-token sigmoid gate; GLM does not."""
        return bool(self.shared_expert_intermediate_size) and self.model_type == "qwen2_moe"

    @property
    def rope(self) -> RopeSpec:
        return RopeSpec(self.rope_type, self.rope_theta, self.rope_factor, self.head_dim,
                        self.max_position_embeddings, dict(self.rope_params),
                        self.partial_rotary_factor)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HFDecoderConfig:
        """Rebuild from ``to_dict`` (a checkpoint manifest); unknown fields are errors."""
        names = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(d) - names)
        if extra:
            raise ValueError(f"HFDecoderConfig: unknown fields {extra}")
        return cls(**d)

    def replace(self, **changes: Any) -> HFDecoderConfig:
        return dataclasses.replace(self, **changes)

    def to_hf(self, dtype: str | None = None) -> dict[str, Any]:
        """The config.json transformers loads: the source keys, ``dtype`` updated."""
        out = dict(self.hf)
        out.pop("quantization_config", None)  # moebit writes its weights unquantized
        if dtype is not None:
            out["dtype"] = dtype
        return out

    @classmethod
    def from_hf(cls, hf: dict[str, Any], ep_size: int = 1) -> HFDecoderConfig:
        """Map a transformers config.json (4.x or 5.x spelling) to the decoder moebit builds."""
        mt = hf.get("model_type")
        if mt in _UNSUPPORTED:
            raise ValueError(f"model_type {mt!r} is not supported: {_UNSUPPORTED[mt]}")
        if mt not in FAMILIES + DENSE_FAMILIES:
            raise ValueError(f"model_type {mt!r} is not supported; "
                             f"supported: {FAMILIES + DENSE_FAMILIES}")
        _check_options(hf, mt)
        if mt == "glm4_moe":  # transformers' defaults, written back so every reader agrees
            hf = {**_GLM4_MOE_DEFAULTS, **hf}
        if mt == gpt_oss.MODEL_TYPE:
            hf = gpt_oss.with_defaults(hf)
            gpt_oss.check(hf)
        hf = with_defaults(hf, mt)
        g = _Getter(hf, mt)
        n_layers, heads = g.need("num_hidden_layers"), g.need("num_attention_heads")
        hidden = g.need("hidden_size")
        mla = mla_fields(hf, mt)  # MLA: one latent for all heads, RoPE over qk_rope_head_dim
        head_dim = g.need("qk_rope_head_dim") if mla else hf.get("head_dim") or hidden // heads
        rope = parse_rope(hf, head_dim, _DEFAULT_THETA.get(mt, 10000.0), _default_partial(hf, mt))
        if rope.partial_rotary_factor != 1.0 and mt not in _PARTIAL_ROTARY:
            raise ValueError(f"{mt}: partial_rotary_factor = {rope.partial_rotary_factor} is "
                             f"not supported (partial RoPE: {sorted(_PARTIAL_ROTARY)} only)")
        return cls(
            model_type=mt, vocab_size=g.need("vocab_size"), hidden_size=hidden,
            num_layers=n_layers, num_heads=heads,
            num_kv_heads=heads if mla else hf.get("num_key_value_heads") or heads, **mla,
            head_dim=head_dim,
            intermediate_size=g.need("intermediate_size"), **_moe_fields(g, n_layers),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta, rope_type=rope.rope_type, rope_factor=rope.factor,
            rope_params=rope.params, max_position_embeddings=rope.max_position_embeddings,
            partial_rotary_factor=rope.partial_rotary_factor,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **_attention_fields(hf, mt),
            clip_qkv=hf.get("clip_qkv"), attention_dropout=float(hf.get("attention_dropout", 0.0)),
            router_aux_loss_coef=_aux_coef(hf, mt),
            ep_size=ep_size, bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"), hf=dict(hf),
        )


class _Getter:
    def __init__(self, hf: dict[str, Any], mt: str) -> None:
        self.hf, self.mt = hf, mt

    def need(self, key: str) -> Any:
        if self.hf.get(key) is None:
            raise ValueError(f"{self.mt} config.json has no {key!r}")
        return self.hf[key]

    def first(self, *keys: str) -> Any:
        for k in keys:
            if self.hf.get(k) is not None:
                return self.hf[k]
        raise ValueError(f"{self.mt} config.json has none of {keys}")


def _moe_fields(g: _Getter, n_layers: int) -> dict[str, Any]:
    """The MoE fields of a family's config; a dense family has no expert and no MoE layer."""
    mt = g.mt
    if mt in DENSE_FAMILIES:
        return dict(moe_intermediate_size=g.need("intermediate_size"), num_experts=0,
                    num_experts_per_tok=0, moe_layers=[])
    if mt in _SIGMOID_ROUTED:
        return _sigmoid_moe_fields(g, n_layers)
    if mt == gpt_oss.MODEL_TYPE:
        return gpt_oss.fields(g.hf)
    if mt in MLA_FAMILIES:
        return deepseek_moe_fields(g.hf, mt, n_layers)
    e = g.first("num_experts", "num_local_experts")
    return dict(
        moe_intermediate_size=(g.need("intermediate_size") if mt in ("mixtral", "olmoe", "flex_olmo")
                               else g.need("moe_intermediate_size")),
        num_experts=e, num_experts_per_tok=g.need("num_experts_per_tok"),
        moe_layers=_moe_layers(g.hf, n_layers, e),
        norm_topk_prob=True if mt == "mixtral" else bool(g.hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(g.need("shared_expert_intermediate_size")
                                         if mt == "qwen2_moe" else 0),
    )


def _sigmoid_moe_fields(g: _Getter, n_layers: int) -> dict[str, Any]:
    """GLM-4.5 MoE and MiniMax-M2: sigmoid scores plus the checkpoint's selection bias;
    GLM adds group-limited top-k, a scaling factor and plain shared experts, MiniMax always
    renormalises the k weights and sizes its experts by ``intermediate_size``."""
    glm = g.mt == "glm4_moe"
    e = g.first("n_routed_experts", "num_local_experts", "num_experts") if glm \
        else g.first("num_local_experts", "num_experts")
    k = g.need("num_experts_per_tok")
    norm = bool(g.hf.get("norm_topk_prob", True)) if glm else True
    if norm and k == 1:
        raise ValueError(f"{g.mt}: num_experts_per_tok = 1 with a renormalised top-k (every "
                         "weight 1) is not supported")
    width = g.need("moe_intermediate_size") if glm else g.need("intermediate_size")
    return dict(
        moe_intermediate_size=width, num_experts=e, num_experts_per_tok=k,
        moe_layers=_moe_layers(g.hf, n_layers, e), norm_topk_prob=norm,
        shared_expert_intermediate_size=width * int(g.hf.get("n_shared_experts") or 0) if glm else 0,
        scoring_func="sigmoid", score_correction_bias=True,
        n_group=int(g.hf.get("n_group") or 1) if glm else 1,
        topk_group=int(g.hf.get("topk_group") or 1) if glm else None,
        routed_scaling_factor=float(g.hf.get("routed_scaling_factor", 1.0)) if glm else 1.0,
    )


def _default_partial(hf: dict[str, Any], mt: str) -> float:
    """The family's partial_rotary_factor when neither spelling of it is given: GLM's 0.5,
    MiniMax-M2's legacy ``rotary_dim`` / head_dim, 1 elsewhere (as transformers)."""
    if mt == "minimax_m2" and hf.get("rotary_dim"):
        return hf["rotary_dim"] / (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    return _PARTIAL_ROTARY.get(mt, 1.0)


def _aux_coef(hf: dict[str, Any], mt: str) -> float:
    """transformers' GLM-4.5 MoE trains with no load-balancing loss (its model computes
    none, whatever the config says); the others weigh theirs by router_aux_loss_coef."""
    return 0.0 if mt in ("glm4_moe",) + MLA_FAMILIES else float(hf.get("router_aux_loss_coef", 0.001))


def _attention_fields(hf: dict[str, Any], mt: str) -> dict[str, Any]:
    """q/k/v biases, q/k norms and where the norms sit: Qwen2 always has q/k/v biases
    (Qwen2-MoE: ``qkv_bias``), Qwen3 per-head q/k norms, OLMoE and OLMo2/FlexOlmo norms over
    the whole projection, OLMo2/FlexOlmo norms after each sublayer."""
    if mt == "qwen2":
        bias = True
    elif mt == "qwen2_moe":
        bias = bool(hf.get("qkv_bias", True))
    else:
        bias = bool(hf.get("attention_bias", False))
    if mt in ("llama", "olmo2", "flex_olmo") and (bias or hf.get("mlp_bias")):
        # their attention_bias also biases o_proj (Llama's mlp_bias the MLP): not in this decoder
        raise ValueError(f"{mt}: attention_bias = {hf.get('attention_bias')} / mlp_bias = "
                         f"{hf.get('mlp_bias')} is not supported (o_proj and MLP biases)")
    qk = {"qwen3_moe": "head", "qwen3": "head", "olmoe": "full", "olmo2": "full",
          "flex_olmo": "full", "minimax_m2": "full"}.get(mt, "none")
    if mt == "glm4_moe" and hf.get("use_qk_norm"):
        qk = "head"
    if mt == "minimax_m2":
        bias = False  # transformers' MiniMax-M2 has no q/k/v biases, whatever the config says
    return dict(attention_bias=bias, qk_norm=qk, post_norm=mt in _POST_NORM)


def _check_options(hf: dict[str, Any], mt: str) -> None:
    """Options whose non-default values moebit does not implement: named errors."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU with 'silu' only)")
    if hf.get("use_sliding_window") or (mt == "mixtral" and hf.get("sliding_window")):
        raise ValueError(f"{mt}: sliding_window attention is not supported "
                         f"(sliding_window = {hf.get('sliding_window')})")
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if sliding and mt != gpt_oss.MODEL_TYPE:  # gpt-oss's own check names its layer types
        raise ValueError(f"{mt}: layer_types {sorted(set(sliding))} are not supported "
                         "(full_attention only)")
    if hf.get("router_jitter_noise"):
        raise ValueError(f"router_jitter_noise = {hf['router_jitter_noise']} is not supported "
                         "(set it to 0)")
    if mt == "minimax_m2":
        _check_minimax(hf)
    if mt in MLA_FAMILIES:
        check_deepseek(hf, mt)


def _check_minimax(hf: dict[str, Any]) -> None:
    """The released MiniMax-M2 config.json's own switches (transformers reads none of them):
    values other than the ones its model hard-codes would mean another model."""
    fixed = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
             "qk_norm_type": "per_layer"}
    for key, want in fixed.items():
        if key in hf and hf[key] != want:
            raise ValueError(f"minimax_m2: {key} = {hf[key]!r} is not supported (only {want!r})")
    attn = [t for t in hf.get("attn_type_list") or [] if t != 1]
    if attn:
        raise ValueError(f"minimax_m2: attn_type_list entries {sorted(set(attn))} are not "
                         "supported (1, full softmax attention, only)")


def _moe_layers(hf: dict[str, Any], n_layers: int, num_experts: int) -> list[int]:
    """Which layers are MoE: every ``decoder_sparse_step``-th, minus ``mlp_only_layers``,
    from ``first_k_dense_replace`` on (the DeepSeek spelling), none without experts."""
    if not num_experts:
        return []
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    first = int(hf.get("first_k_dense_replace", 0) or 0)
    return [i for i in range(n_layers)
            if i not in dense and (i + 1) % step == 0 and i >= first]


def read_config(path: str | Path, ep_size: int = 1) -> HFDecoderConfig:
    """The decoder config of a Hugging Face folder's ``config.json`` (errors name the key)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist: not a Hugging Face model folder")
    try:
        hf = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{p} is not a JSON object (got {type(hf).__name__})")
    try:
        return HFDecoderConfig.from_hf(hf, ep_size=ep_size)
    except (ValueError, TypeError) as e:  # a key missing, of the wrong type, or unsupported
        raise ValueError(f"{p}: {e}") from None
