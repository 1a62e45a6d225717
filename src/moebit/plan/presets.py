"""The papers' models, with the parameter totals their papers state.

Sources (cited in docs/plan.md):

- BERT-Large: Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers",
  section 3: L=24, H=1024, A=16, 340M parameters; WordPiece vocabulary 30,522, 512
  positions. 1-bit Adam (Tang et al. 2021) pre-trains it at sequence length 128 (and 512).
- GPT-style dense bases and MoE variants: Rajbhandari et al. 2022, "DeepSpeed-MoE",
  section 3 (Table 1 / Table 4): 350M (24 layers, hidden 1024, 16 heads), 1.3B (24 layers,
  hidden 2048, 16 heads), 6.7B (32 layers, hidden 4096, 32 heads), MoE-128 on every other
  layer: 350M+MoE-128 = 13B and 1.3B+MoE-128 = 52B; PR-MoE (residual MLP + experts; the
  last two MoE layers with twice the experts): 350M+PR-MoE-32/64 = 4B,
  1.3B+PR-MoE-64/128 = 31B. GPT-2 vocabulary (50,257), sequence length 2048, top-1 gating.
- Mixtral-8x7B: Jiang et al. 2024, "Mixtral of Experts", section 2: 47B total (46.7B on
  the model card), 13B active; its config.json shapes.
"""

from __future__ import annotations

from moebit.plan.spec import ModelSpec, SpecError

_BERT_VOCAB, _GPT2_VOCAB = 30522, 50257


def _bert_large() -> ModelSpec:
    d, v = 1024, _BERT_VOCAB
    # token-type table (2 rows), embedding LayerNorm, pooler (d x d + d), MLM transform
    # (d x d + d, LayerNorm) and the MLM output bias (vocab): what a decoder lacks.
    extra = 2 * d + 2 * d + (d * d + d) + (d * d + d + 2 * d) + v
    return ModelSpec("bert-large", 24, d, 16, 4 * d, v, 128, learned_positions=512,
                     extra_params=extra, published_params=340e6,
                     source="Devlin et al. 2019, BERT, section 3 (BERT-LARGE: 340M)")


def _gpt(name: str, d: int, experts: list[int] | None, published: float, residual: bool = False,
         source: str = "") -> ModelSpec:
    return ModelSpec(name, 24, d, 16, 4 * d, _GPT2_VOCAB, 2048, learned_positions=2048,
                     experts=experts or [], residual_mlp=residual, published_params=published,
                     source=source or "Rajbhandari et al. 2022, DeepSpeed-MoE, section 3, Table 1")


def _every_other(n_layer: int, counts: list[int]) -> list[int]:
    """Experts on every other block (the 2nd, 4th, ...), ``counts`` in order."""
    out = [0] * n_layer
    for i, c in zip(range(1, n_layer, 2), counts, strict=True):
        out[i] = c
    return out


def _mixtral() -> ModelSpec:
    return ModelSpec("mixtral-8x7b", 32, 4096, 32, 14336, 32000, 4096, n_kv_head=8,
                     ffn_matrices=3, biases=False, tied_embeddings=False, experts=[8] * 32,
                     top_k=2, published_params=46.7e9,
                     source="Jiang et al. 2024, Mixtral of Experts, section 2 (46.7B total)")


PRESETS = {
    "bert-large": _bert_large,
    "gpt-350m": lambda: _gpt("gpt-350m", 1024, None, 350e6),
    "gpt-1.3b": lambda: _gpt("gpt-1.3b", 2048, None, 1.3e9),
    "gpt-6.7b": lambda: ModelSpec("gpt-6.7b", 32, 4096, 32, 4 * 4096, _GPT2_VOCAB, 2048,
                                  learned_positions=2048, published_params=6.7e9,
                                  source="Rajbhandari et al. 2022, DeepSpeed-MoE, section 3"),
    "gpt-350m-moe128": lambda: _gpt("gpt-350m-moe128", 1024, _every_other(24, [128] * 12), 13e9),
    "gpt-1.3b-moe128": lambda: _gpt("gpt-1.3b-moe128", 2048, _every_other(24, [128] * 12), 52e9),
    "gpt-350m-pr-moe-32-64": lambda: _gpt("gpt-350m-pr-moe-32-64", 1024,
                                          _every_other(24, [32] * 10 + [64] * 2), 4e9, True),
    "gpt-1.3b-pr-moe-64-128": lambda: _gpt("gpt-1.3b-pr-moe-64-128", 2048,
                                           _every_other(24, [64] * 10 + [128] * 2), 31e9, True),
    "mixtral-8x7b": _mixtral,
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]()
    except KeyError:
        raise SpecError(f"model: unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
