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

DROP_POLICIES = ("position", "random")
NOISE_POLICIES = ("none", "jitter", "rsample")

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
    "norm_topk_prob": "normalize_topk_weights",
}


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
    normalize_topk_weights: rescale the k gate weights of a token to sum to 1 (k > 1 only;
        with k = 1 it would make every weight 1 and cut the router off the LM loss).
    router_aux_loss_coef / router_z_loss_coef: weights of the load-balancing loss and
        the router z-loss in `MoEOutput.aux_loss`.
    residual: Residual MoE (a dense MLP beside the MoE, mixed per token).
    ep_size: expert-parallel ranks sharing the E experts (E % ep_size == 0).
    d_ffn: hidden size of each expert's MLP; None means 4 * d_model.
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
    normalize_topk_weights: bool = True
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    residual: bool = False
    ep_size: int = 1
    d_ffn: int | None = None
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
            else:
                known = sorted(fields | set(_ALIASES) | {"use_rts", "noisy_gate_policy"})
                raise ValueError(f"unknown MoE config key {key!r}; known keys: {', '.join(known)}")
        return cls(**out)


def _noise_from_deepspeed(value: Any) -> str:
    if value is None:
        return "none"
    v = str(value).lower()
    if v in NOISE_POLICIES:
        return v
    raise ValueError(
        f"noisy_gate_policy must be None, 'Jitter' or 'RSample', got {value!r}"
    )
