"""What a performance model needs to know about a transformer: shapes, parameters, FLOPs.

One flat description covers moebit's GPT (GELU MLP, tied embeddings, learned positions,
biases), BERT (an encoder with a pooler and an MLM head) and Hugging Face MoE decoders
(SwiGLU experts, grouped-query attention, shared experts, untied heads). Parameter counts
are exact for moebit's GPT (tested against ``GPT.num_params``) and within a few percent of
the published totals for the papers' models (tests/plan/test_presets.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SpecError(ValueError):
    """A model or cluster setting is missing or out of range; the message names it."""


@dataclass
class ModelSpec:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    d_ffn: int
    vocab_size: int
    seq_len: int  # the sequence length a step trains on
    n_kv_head: int = 0  # 0: as many as n_head (no grouped-query attention)
    ffn_matrices: int = 2  # 2: GELU MLP (fc, proj); 3: SwiGLU (gate, up, down)
    biases: bool = True
    tied_embeddings: bool = True
    learned_positions: int = 0  # rows of a learned position table (0: rotary, no table)
    extra_params: int = 0  # what the layer formula misses (BERT pooler, MLM head, types)
    # Mixture of experts: one entry per block, 0 for a dense block.
    experts: list[int] = field(default_factory=list)
    top_k: int = 1
    expert_d_ffn: int = 0  # 0: d_ffn
    residual_mlp: bool = False  # PR-MoE: a dense MLP beside the experts in each MoE block
    shared_expert_d_ffn: int = 0  # Qwen2-MoE / DeepSeek: an always-on expert of this width
    published_params: float | None = None  # the total the source states, if any
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("n_layer", "d_model", "n_head", "d_ffn", "vocab_size", "seq_len", "top_k"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SpecError(f"model.{key}: must be a positive integer (got {v!r})")
        if self.d_model % self.n_head:
            raise SpecError(f"model.n_head: must divide d_model={self.d_model} (got {self.n_head})")
        if self.ffn_matrices not in (2, 3):
            raise SpecError(f"model.ffn_matrices: must be 2 (GELU) or 3 (SwiGLU), got {self.ffn_matrices}")
        if not self.experts:
            self.experts = [0] * self.n_layer
        if len(self.experts) != self.n_layer:
            raise SpecError(f"model.experts: lists {len(self.experts)} blocks, "
                            f"model has n_layer={self.n_layer}")
        if any(e < 0 for e in self.experts):
            raise SpecError(f"model.experts: counts must be >= 0 (got {self.experts})")
        moe = [e for e in self.experts if e]
        if moe and self.top_k > min(moe):
            raise SpecError(f"model.top_k: {self.top_k} exceeds the smallest expert count {min(moe)}")
        for key in ("n_kv_head", "expert_d_ffn", "shared_expert_d_ffn", "learned_positions",
                    "extra_params"):
            if getattr(self, key) < 0:
                raise SpecError(f"model.{key}: must be >= 0 (got {getattr(self, key)})")

    # ------------------------------------------------------------------ shapes
    @property
    def is_moe(self) -> bool:
        return any(self.experts)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, e in enumerate(self.experts) if e]

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def e_ffn(self) -> int:
        return self.expert_d_ffn or self.d_ffn

    # ------------------------------------------------------------------ parameters
    def _ffn(self, width: int) -> int:
        d = self.d_model
        w = self.ffn_matrices * d * width
        return w + (width + d if self.biases else 0)

    def attention_params(self) -> int:
        d, dh = self.d_model, self.d_model // self.n_head
        kv = 2 * d * self.kv_heads * dh
        w = 2 * d * d + kv
        b = (2 * d + 2 * self.kv_heads * dh) if self.biases else 0
        return w + b

    def norm_params(self) -> int:
        return 2 * self.d_model if self.biases else self.d_model

    def expert_params(self) -> int:
        """One expert's parameters."""
        return self._ffn(self.e_ffn)

    def block_params(self, layer: int) -> tuple[int, int]:
        """(dense, expert) parameters of one block; the router counts as dense."""
        dense = self.attention_params() + 2 * self.norm_params()
        e = self.experts[layer]
        if not e:
            return dense + self._ffn(self.d_ffn), 0
        dense += self.d_model * e  # router
        if self.residual_mlp:
            dense += self._ffn(self.d_ffn) + 2 * self.d_model + 2  # MLP and mixing coefficient
        if self.shared_expert_d_ffn:
            dense += self._ffn(self.shared_expert_d_ffn) + self.d_model  # and its gate
        return dense, e * self.expert_params()

    def embedding_params(self) -> int:
        d = self.d_model
        n = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return n + self.learned_positions * d + self.norm_params()  # final norm

    def dense_params(self) -> int:
        return self.embedding_params() + self.extra_params + sum(
            self.block_params(i)[0] for i in range(self.n_layer))

    def expert_total_params(self) -> int:
        return sum(self.block_params(i)[1] for i in range(self.n_layer))

    def total_params(self) -> int:
        return self.dense_params() + self.expert_total_params()

    def active_params(self) -> int:
        """Parameters one token passes through: dense ones plus top_k experts per MoE block."""
        return self.dense_params() + len(self.moe_layers) * self.top_k * self.expert_params()

    # ------------------------------------------------------------------ FLOPs
    def train_flops_per_token(self) -> float:
        """6 x (active matmul parameters) + 12 x n_layer x seq x d (attention scores).

        Embedding lookups do no multiply-adds, the output projection (vocab x d) does, tied
        or not. The attention term counts QK^T and AV over the full square, as a dense
        kernel computes them (Megatron's convention), forward plus twice for backward.
        """
        lookup = self.vocab_size * self.d_model * (0 if self.tied_embeddings else 1)
        lookup += self.learned_positions * self.d_model
        matmul = self.active_params() - lookup - self.extra_params
        return 6.0 * matmul + 12.0 * self.n_layer * self.seq_len * self.d_model

    def summary(self) -> dict[str, object]:
        return {
            "name": self.name, "n_layer": self.n_layer, "d_model": self.d_model,
            "n_head": self.n_head, "d_ffn": self.d_ffn, "vocab_size": self.vocab_size,
            "seq_len": self.seq_len, "experts": self.experts, "top_k": self.top_k,
            "total_params": self.total_params(), "dense_params": self.dense_params(),
            "expert_params": self.expert_total_params(), "active_params": self.active_params(),
            "train_flops_per_token": self.train_flops_per_token(),
            "published_params": self.published_params, "source": self.source,
        }
