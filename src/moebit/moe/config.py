"""`MoEConfig`: every knob of one MoE layer, Hugging Face names first, DeepSpeed names as aliases.

A config is validated when built, so a bad combination (k > E, E not divisible by
ep_size, an unknown noise policy) fails at model construction with the key named,
not deep inside a forward pass on one rank of many.

    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2)
    cfg = MoEConfig.from_dict({"k": 2, "num_experts": 8, "use_rts": True, "ep_size": 2})
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moebit.comm.all_to_all import check_wire_dtype
from moebit.moe.glu import ClampedSwiGLU

DROP_POLICIES = ("position", "random")
NOISE_POLICIES = ("none", "jitter", "rsample")
EXPERT_TYPES = ("gelu_mlp", "swiglu", "geglu")  # gated types: down(act(x W_gate) * (x W_up))
KERNELS = ("auto", "loop", "padded", "grouped", "threaded")
SCORING_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")  # a group's score: its best two experts summed, or its best

# DeepSpeed (deepspeed.moe.layer.MoE) and other common spellings -> our field names.
_ALIASES = {
    "k": "num_experts_per_tok",
    "top_k": "num_experts_per_tok",
    "moe_top_k": "num_experts_per_tok",
    "num_local_experts": "num_experts",
    "moe_num_experts": "num_experts",
    "use_residual": "residual",
    "aux_loss_coef": "router_aux_loss_coef",
    "moe_loss_coeff": "router_aux_loss_coef",
    "z_loss_coef": "router_z_loss_coef",
    "ffn_hidden_size": "d_ffn",
    "moe_intermediate_size": "d_ffn",
    "normalize_topk_weights": "norm_topk_prob",
    # expert blocks (Megatron-Core, DeepSeek and Qwen spellings)
    "n_shared_experts": "num_shared_experts",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "moe_shared_expert_gate": "shared_expert_gate",
}
# Routing (DeepSeek-V3 names are the fields; Megatron-Core spellings are aliases).
_ALIASES.update({
    "moe_router_score_function": "scoring_func",
    "moe_router_pre_softmax": "softmax_before_topk",
    "moe_router_num_groups": "n_group",
    "moe_router_group_topk": "topk_group",
    "moe_router_topk_scaling_factor": "routed_scaling_factor",
    "moe_router_bias_update_rate": "bias_update_speed",
    "aux_loss_alpha": "router_aux_loss_coef",
})
# Megatron's moe_router_load_balancing_type values -> seq_aux.
_BALANCING_TYPES = {"aux_loss": False, "seq_aux_loss": True}


@dataclass
class MoEConfig:
    """One MoE layer.

    num_experts: E, experts in the layer across all expert-parallel ranks.
    num_experts_per_tok: k, experts each token is sent to (any 1 <= k <= E).
    capacity_factor / eval_capacity_factor: capacity = ceil(k * cf * S / E) slots per
        expert, at least min_capacity and at most S (the number of tokens), in training
        and in eval mode respectively.
    drop_tokens: False routes every token (dropless); True drops overflow tokens, whose
        MoE output is then zero (the residual stream carries them).
    drop_policy: which overflow tokens survive: "position" (earlier tokens first) or
        "random" (Random Token Selection). Either way first choices beat second choices.
    noise: "jitter" multiplies the router input by U[0.99, 1.01]; "rsample" adds Gumbel
        noise to the logits used for selection. Training only.
    norm_topk_prob: rescale the k gate weights of a token to sum to 1 (k > 1 only;
        with k = 1 it would make every weight 1 and cut the router off the LM loss).
    router_aux_loss_coef / router_z_loss_coef: weights of the load-balancing loss and
        the router z-loss in `MoEOutput.aux_loss`.
    residual: Residual MoE (a dense MLP beside the MoE, mixed per token).
    ep_size: expert-parallel ranks sharing the E experts (E % ep_size == 0).
    d_ffn: hidden size of each expert's MLP; None means 4 * d_model.

    Expert blocks (docs/moe.md):
    expert_type: "gelu_mlp" (Linear, GELU, Linear), "swiglu" or "geglu" (the gated
        ``down(act(x W_gate) * (x W_up))`` with SiLU or GELU). Also the shared experts' type.
    expert_bias: biases on the expert projections; None means the type's default (True for
        "gelu_mlp", False for gated types; True with a gated type is gpt-oss's biased
        ``gate_up_proj`` / ``down_proj``, routed experts only: shared experts have none).
    swiglu_alpha / swiglu_limit / swiglu_up_shift: gpt-oss's clamped SwiGLU (expert_type
        "swiglu" only): ``(clamp(up, -limit, limit) + up_shift) * g * sigmoid(alpha * g)``
        with ``g = min(gate, limit)`` (gpt-oss: 1.702, 7.0, 1.0). The defaults (1, None, 0)
        are the plain SwiGLU.
    router_bias: a bias on the router's Linear (gpt-oss), in its logits (float32).
    num_shared_experts: dense experts every token passes through, summed with the routed
        output (DeepSeek ``n_shared_experts``; run as one MLP of the summed width).
    shared_expert_intermediate_size: width of that MLP; 0 means ``d_ffn * num_shared_experts``
        (Qwen2-MoE / Megatron name it so).
    shared_expert_gate: Qwen2-MoE's per-token ``sigmoid(Linear(d, 1))`` factor on it.
    kernel: how the routed experts run: "loop", "padded", "grouped" (torch grouped_mm),
        "threaded" (experts spread over CPU threads, one single-threaded GEMM each) or
        "auto" (chosen per call from measured rules, see ``moebit.moe.experts``).
    Routing (docs/moe-routing.md), defaults = the GShard/Switch router above:
    scoring_func: "softmax" or "sigmoid" (DeepSeek-V3) expert scores.
    softmax_before_topk: softmax over all E then top-k (default); False picks the top-k
        logits and softmaxes over those k (Mixtral, Megatron's default): the k weights then
        sum to 1 at any k, k = 1 included. Softmax scoring only.
    n_group / topk_group: group-limited top-k: the E experts form n_group groups, a group
        scores the sum of its best two experts, a token picks among the experts of its
        topk_group best groups only. n_group 1 (default) is plain top-k; topk_group None
        keeps every group.
    group_score: how a group scores: "top2_sum" (its best two experts' selection scores
        summed: DeepSeek-V3's noaux_tc) or "max" (its best one: DeepSeek-V2's
        group_limited_greedy).
    routed_scaling_factor: multiplies the final gate weights (DeepSeek-V3 uses 2.5).
    bias_update_speed: aux-loss-free balancing: > 0 adds a per-expert bias
        (``e_score_correction_bias``) to the scores for selection only, moved by this much
        per optimizer step towards the mean load (``update_router_biases_``). 0 = off.
    score_correction_bias: hold ``e_score_correction_bias`` even with bias_update_speed 0:
        a checkpoint's fixed selection bias (GLM-4.5 MoE, MiniMax-M2 and DeepSeek-V3 ship
        one), loaded with the weights and used as it is, never moved.
    seq_aux: the load-balancing loss per sequence, averaged over sequences (DeepSeek-V3's
        sequence-wise loss) instead of over the whole batch (GShard).
    a2a_dtype / a2a_grad_dtype: wire format of the expert-parallel token all-to-alls,
        forward (dispatch and combine) and backward (their gradients): "auto" (the
        tensor's own dtype: the compute dtype under autocast), fp32, bf16, fp16, int8
        (per-token scales) or fp8_e4m3 (where torch has it on the device).
    a2a_hierarchical: exchange tokens inside each node first, then across nodes (one
        message per remote node); only differs from flat when ep spans nodes.
    a2a_chunks: split each layer's exchange into this many chunks so that one chunk's
        expert compute overlaps the next chunk's all-to-all (1: no overlap).
    """

    num_experts: int = 8
    num_experts_per_tok: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    drop_policy: str = "position"
    noise: str = "none"
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    residual: bool = False
    ep_size: int = 1
    d_ffn: int | None = None
    # expert blocks: keep these together (routing keys live in their own block)
    expert_type: str = "gelu_mlp"
    expert_bias: bool | None = None
    swiglu_alpha: float = 1.0
    swiglu_limit: float | None = None
    swiglu_up_shift: float = 0.0
    router_bias: bool = False
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    kernel: str = "auto"
    # routing
    scoring_func: str = "softmax"
    softmax_before_topk: bool = True
    n_group: int = 1
    topk_group: int | None = None
    group_score: str = "top2_sum"
    routed_scaling_factor: float = 1.0
    bias_update_speed: float = 0.0
    score_correction_bias: bool = False
    seq_aux: bool = False
    # token all-to-all of expert parallelism (docs/expert-parallel.md)
    a2a_dtype: str = "auto"
    a2a_grad_dtype: str = "auto"
    a2a_hierarchical: bool = False
    a2a_chunks: int = 1

    def __post_init__(self) -> None:
        self.validate()

    @property
    def k(self) -> int:
        return self.num_experts_per_tok

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def validate(self) -> None:
        """Raise ValueError naming the offending key."""
        e, k = self.num_experts, self.num_experts_per_tok
        if not isinstance(e, int) or e < 1:
            raise ValueError(f"num_experts must be a positive int, got {e!r}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"num_experts_per_tok (k) must be a positive int, got {k!r}")
        if k > e:
            raise ValueError(
                f"num_experts_per_tok (k) = {k} is larger than num_experts = {e}: "
                "a token cannot pick more distinct experts than exist"
            )
        if not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(f"ep_size must be a positive int, got {self.ep_size!r}")
        if e % self.ep_size:
            raise ValueError(
                f"num_experts = {e} is not divisible by ep_size = {self.ep_size}: "
                "every expert-parallel rank must hold the same number of experts"
            )
        for name in ("capacity_factor", "eval_capacity_factor"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise ValueError(f"min_capacity must be an int >= 0, got {self.min_capacity!r}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {self.drop_policy!r}")
        if self.noise not in NOISE_POLICIES:
            raise ValueError(f"noise must be one of {NOISE_POLICIES}, got {self.noise!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            v = getattr(self, name)
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v!r}")
        if self.d_ffn is not None and (not isinstance(self.d_ffn, int) or self.d_ffn < 1):
            raise ValueError(f"d_ffn must be a positive int or None, got {self.d_ffn!r}")
        self._validate_expert_block()
        self._validate_routing()
        self._validate_a2a()

    def _validate_expert_block(self) -> None:
        if self.expert_type not in EXPERT_TYPES:
            raise ValueError(f"expert_type must be one of {EXPERT_TYPES}, got {self.expert_type!r}")
        if self.expert_bias not in (None, True, False):
            raise ValueError(f"expert_bias must be a bool or None, got {self.expert_bias!r}")
        n = self.num_shared_experts
        if self.expert_bias and self.gated and (n or self.residual):
            raise ValueError(
                f"expert_bias = True with expert_type = {self.expert_type!r} and shared experts "
                "(or residual): gated shared experts have no biases"
            )
        self._validate_glu()
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {n!r}")
        w = self.shared_expert_intermediate_size
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"shared_expert_intermediate_size must be an int >= 0, got {w!r}")
        if w and not n and not self.residual:
            raise ValueError(
                f"shared_expert_intermediate_size = {w} but num_shared_experts = 0: "
                "there is no shared expert to size"
            )
        if self.shared_expert_gate not in (True, False):
            raise ValueError(f"shared_expert_gate must be a bool, got {self.shared_expert_gate!r}")
        if self.shared_expert_gate and not n and not self.residual:
            raise ValueError("shared_expert_gate = True needs num_shared_experts >= 1")
        if self.residual and (n > 1 or self.shared_expert_gate):
            raise ValueError(
                "residual = True is Residual MoE: one shared expert mixed with the routed "
                "output by a learned two-way softmax; it cannot take num_shared_experts > 1 "
                "or shared_expert_gate (shared experts summed with the routed output)"
            )
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")

    def _validate_glu(self) -> None:
        a, lim, sh = self.swiglu_alpha, self.swiglu_limit, self.swiglu_up_shift
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0:
            raise ValueError(f"swiglu_alpha must be a number > 0, got {a!r}")
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, (int, float))
                                or not lim > 0):
            raise ValueError(f"swiglu_limit must be a number > 0 or None, got {lim!r}")
        if isinstance(sh, bool) or not isinstance(sh, (int, float)):
            raise ValueError(f"swiglu_up_shift must be a number, got {sh!r}")
        if self.expert_act is not None and self.expert_type != "swiglu":
            raise ValueError(f"swiglu_alpha / swiglu_limit / swiglu_up_shift need expert_type "
                             f"'swiglu', got {self.expert_type!r}")
        if self.expert_act is not None and (self.num_shared_experts or self.residual):
            raise ValueError("the clamped SwiGLU (swiglu_alpha / swiglu_limit / swiglu_up_shift) "
                             "is for routed experts only: not with shared experts or residual")
        if self.router_bias not in (True, False):
            raise ValueError(f"router_bias must be a bool, got {self.router_bias!r}")

    @property
    def expert_act(self) -> ClampedSwiGLU | None:
        """The routed experts' clamped SwiGLU, or None for the type's own activation."""
        act = ClampedSwiGLU(float(self.swiglu_alpha), self.swiglu_limit, float(self.swiglu_up_shift))
        return None if act == ClampedSwiGLU() else act

    @property
    def gated(self) -> bool:
        return self.expert_type != "gelu_mlp"

    @property
    def has_expert_bias(self) -> bool:
        return (not self.gated) if self.expert_bias is None else bool(self.expert_bias)

    def shared_ffn_size(self, d_model: int) -> int:
        """Width of the shared-expert MLP (Residual MoE's dense MLP: one expert's width)."""
        if self.shared_expert_intermediate_size:
            return self.shared_expert_intermediate_size
        return self.ffn_size(d_model) * max(self.num_shared_experts, 1)

    def _validate_routing(self) -> None:
        e, k, g = self.num_experts, self.num_experts_per_tok, self.n_group
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}"
            )
        if not self.softmax_before_topk and self.scoring_func != "softmax":
            raise ValueError("softmax_before_topk = False (top-k then softmax) needs "
                             f"scoring_func 'softmax', got {self.scoring_func!r}")
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"n_group must be a positive int, got {g!r}")
        if e % g:
            raise ValueError(f"n_group = {g} does not divide num_experts = {e}: "
                             "every group must hold the same number of experts")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        tg = self.topk_group
        if tg is not None:
            if isinstance(tg, bool) or not isinstance(tg, int) or tg < 1:
                raise ValueError(f"topk_group must be a positive int or None, got {tg!r}")
            if tg > g:
                raise ValueError(f"topk_group = {tg} is larger than n_group = {g}")
            if k > tg * (e // g):
                raise ValueError(
                    f"num_experts_per_tok (k) = {k} is larger than the {tg * (e // g)} experts "
                    f"that topk_group = {tg} groups of {e // g} leave to choose from"
                )
        if not self.routed_scaling_factor > 0:
            raise ValueError(
                f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}"
            )
        if not self.bias_update_speed >= 0:
            raise ValueError(
                f"bias_update_speed must be >= 0 (0 = off), got {self.bias_update_speed!r}"
            )
        if self.score_correction_bias not in (True, False):
            raise ValueError("score_correction_bias must be a bool, "
                             f"got {self.score_correction_bias!r}")

    @property
    def groups_kept(self) -> int:
        """Groups a token may pick experts from (n_group when not limited)."""
        return self.n_group if self.topk_group is None else self.topk_group

    def _validate_a2a(self) -> None:
        check_wire_dtype(self.a2a_dtype, "a2a_dtype")
        check_wire_dtype(self.a2a_grad_dtype, "a2a_grad_dtype")
        if not isinstance(self.a2a_chunks, int) or self.a2a_chunks < 1:
            raise ValueError(f"a2a_chunks must be an int >= 1, got {self.a2a_chunks!r}")
        if self.a2a_chunks > 1 and self.a2a_hierarchical:
            raise ValueError("a2a_chunks > 1 overlaps the flat exchange only; it cannot be "
                             "combined with a2a_hierarchical")

    def ffn_size(self, d_model: int) -> int:
        return self.d_ffn if self.d_ffn is not None else 4 * d_model

    def replace(self, **changes: Any) -> MoEConfig:
        """A validated copy with some fields changed (e.g. a per-layer num_experts)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEConfig:
        """Build from our names or DeepSpeed's (k, use_residual, use_rts, noisy_gate_policy...).

        Unknown keys raise ValueError naming them; a key given twice under two spellings
        raises too, so a config never silently means something else.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        source: dict[str, str] = {}

        def put(name: str, value: Any, key: str) -> None:
            if name in out:
                raise ValueError(f"MoE config sets {name!r} twice (via {source[name]!r} and {key!r})")
            out[name] = value
            source[name] = key

        for key, value in d.items():
            if key in fields:
                put(key, value, key)
            elif key in _ALIASES:
                put(_ALIASES[key], value, key)
            elif key == "use_rts":
                put("drop_policy", "random" if value else "position", key)
            elif key == "noisy_gate_policy":
                put("noise", _noise_from_deepspeed(value), key)
            elif key == "moe_grouped_gemm":  # Megatron-Core: grouped GEMM or SequentialMLP
                put("kernel", "grouped" if value else "loop", key)
            elif key == "moe_router_load_balancing_type":
                put("seq_aux", _seq_aux_from_megatron(value), key)
            else:
                known = sorted(fields | set(_ALIASES) | _SPECIAL_KEYS)
                raise ValueError(f"unknown MoE config key {key!r}; known keys: {', '.join(known)}")
        return cls(**out)


_SPECIAL_KEYS = {"use_rts", "noisy_gate_policy", "moe_grouped_gemm", "moe_router_load_balancing_type"}


def _noise_from_deepspeed(value: Any) -> str:
    if value is None:
        return "none"
    v = str(value).lower()
    if v in NOISE_POLICIES:
        return v
    raise ValueError(
        f"noisy_gate_policy must be None, 'Jitter' or 'RSample', got {value!r}"
    )


def _seq_aux_from_megatron(value: Any) -> bool:
    if value in _BALANCING_TYPES:
        return _BALANCING_TYPES[value]
    raise ValueError(
        f"moe_router_load_balancing_type must be one of {sorted(_BALANCING_TYPES)} "
        f"(for no loss set router_aux_loss_coef = 0), got {value!r}"
    )
