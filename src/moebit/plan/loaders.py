"""A ModelSpec from a moebit training config, a Hugging Face config.json, or a preset name.

A moebit config is read with moebit's own loader (the keys ``moebit train`` takes), so a
plan describes exactly the model that ``moebit train --config`` would build. A Hugging
Face config is recognised by its keys (``hidden_size``, ``num_hidden_layers``): Mixtral,
Qwen2-MoE/Qwen3-MoE, OLMoE and DeepSeek-MoE name the same things differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moebit.plan.presets import PRESETS, preset
from moebit.plan.spec import ModelSpec, SpecError
from moebit.training.config import ConfigError, TrainConfig, build, load_file


def from_train_config(cfg: TrainConfig, name: str = "moebit") -> ModelSpec:
    g = cfg.model_config()
    return ModelSpec(
        name, g.n_layer, g.d_model, g.n_head, g.d_ffn, g.vocab_size, g.block_size,
        learned_positions=g.block_size, experts=[g.experts_at(i) for i in range(g.n_layer)],
        top_k=cfg.moe.k if cfg.moe else 1, residual_mlp=bool(cfg.moe and cfg.moe.residual),
        source="moebit GPT (models/gpt.py)",
    )


def _need(raw: dict[str, Any], where: str, *keys: str) -> Any:
    for k in keys:
        if k in raw and raw[k] is not None:
            return raw[k]
    raise SpecError(f"{where}: missing {' or '.join(keys)}")


def from_hf_config(raw: dict[str, Any], where: str = "config.json") -> ModelSpec:
    """Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-style keys (dense models too)."""
    n_layer = int(_need(raw, where, "num_hidden_layers", "n_layer"))
    d = int(_need(raw, where, "hidden_size", "d_model"))
    heads = int(_need(raw, where, "num_attention_heads", "n_head"))
    ffn = int(_need(raw, where, "intermediate_size"))
    vocab = int(_need(raw, where, "vocab_size"))
    seq = int(raw.get("max_position_embeddings") or 2048)
    e = int(raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts") or 0)
    experts = [0] * n_layer
    if e:
        first_dense = int(raw.get("first_k_dense_replace") or 0)  # DeepSeek
        step = int(raw.get("decoder_sparse_step") or raw.get("moe_layer_freq") or 1)  # Qwen / DeepSeek
        dense_only = set(raw.get("mlp_only_layers") or [])  # Qwen
        for i in range(n_layer):
            if i >= first_dense and (i + 1) % step == 0 and i not in dense_only:
                experts[i] = e
    shared = int(raw.get("shared_expert_intermediate_size") or 0)  # Qwen2-MoE
    if not shared and raw.get("n_shared_experts"):  # DeepSeek: that many experts' width
        shared = int(raw["n_shared_experts"]) * int(raw.get("moe_intermediate_size") or ffn)
    try:
        return ModelSpec(
            str(raw.get("_name_or_path") or raw.get("model_type") or where), n_layer, d, heads,
            ffn, vocab, seq, n_kv_head=int(raw.get("num_key_value_heads") or heads),
            ffn_matrices=3, biases=bool(raw.get("attention_bias", False)),
            tied_embeddings=bool(raw.get("tie_word_embeddings", False)), experts=experts,
            top_k=int(raw.get("num_experts_per_tok") or 1) if e else 1,
            expert_d_ffn=int(raw.get("moe_intermediate_size") or 0), shared_expert_d_ffn=shared,
            source=f"Hugging Face config {where}",
        )
    except SpecError as err:
        raise SpecError(f"{where}: {err}") from None


def load_model(arg: str, overrides: dict[str, Any] | None = None) -> tuple[ModelSpec, TrainConfig | None]:
    """``arg`` is a preset name, a moebit .toml/.json config, or a Hugging Face config.json.

    Returns the spec and, for a moebit config, the TrainConfig (its batch, optimizer and
    ep_size seed the setup). ``overrides`` are moebit config keys (e.g. from bench flags).
    """
    if arg in PRESETS:
        return preset(arg), None
    p = Path(arg)
    if not p.is_file():
        raise SpecError(f"model: {arg!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    if p.suffix == ".json":
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise SpecError(f"model {arg!r}: cannot parse JSON: {e}") from None
        if isinstance(raw, dict) and ("hidden_size" in raw or "num_hidden_layers" in raw):
            return from_hf_config(raw, str(p)), None
    try:
        cfg = build(load_file(arg), overrides, source=arg)
    except ConfigError as e:
        raise SpecError(f"model {arg!r}: {e}") from None
    return from_train_config(cfg, p.stem), cfg
