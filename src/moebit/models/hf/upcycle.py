"""Sparse upcycling of a Hugging Face dense model into its MoE family.

Llama becomes Mixtral, Qwen2 Qwen2-MoE, Qwen3 Qwen3-MoE, OLMo2 FlexOlmo (OLMo2's
post-norm layers with OLMoE's experts; OLMoE itself is pre-norm): the attention, norms, embeddings
and the MLPs of the layers that stay dense are copied unchanged, each MoE layer's experts
are copies of that layer's dense MLP (optionally with Gaussian noise) and its router is
N(0, router_std), near zero. With renormalised top-k weights (Mixtral always;
``norm_topk_prob`` on the others, the default here) a token's k weights sum to 1 and
identical experts give back the dense MLP's output, so the upcycled model computes what the
dense one did (Komatsuzaki et al. 2022, "Sparse Upcycling") until training moves it. The
algorithm is ``moebit.models.upcycling``; this module maps the Hugging Face names.

The output is an ordinary Hugging Face folder: the MoE family's ``config.json`` and sharded
safetensors in the per-expert layout that transformers' ``save_pretrained`` writes (shard
1: every tensor outside the MoE layers' MLPs; then one shard per MoE layer, so at most one
layer's experts are in memory at a time), plus the source's tokenizer and generation files.
transformers, ``moebit.hf.from_pretrained`` and ``moebit train --init-from`` load it.

    upcycle_folder("llama-dense/", "mixtral-up/", UpcycleSpec(num_experts=8))   # moebit.upcycle
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moebit.models.hf.config import FAMILIES, HFDecoderConfig
from moebit.models.hf.folder import copy_side_files
from moebit.models.hf.weights import INDEX, SafetensorsFolder
from moebit.models.upcycling import ExpertCopier, UpcycleSpec, starts_at_dense, warn_unless_dense

# dense family -> the MoE family it upcycles into (same attention, norms and RoPE)
SIBLINGS = {"llama": "mixtral", "qwen2": "qwen2_moe", "qwen3": "qwen3_moe", "olmo2": "flex_olmo"}
# MoE families with every layer MoE (no decoder_sparse_step / mlp_only_layers)
_ALL_MOE = ("mixtral", "flex_olmo")
# per-expert tensor names (gate, up, down) and the MoE block's module name, by MoE family
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
# dense config keys with no meaning (or another one) in the MoE family's config
_DROP_KEYS = {"model_type", "architectures", "auto_map", "_name_or_path", "mlp_bias",
              "pretraining_tp", "attention_bias"}
_ARCHS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM", "flex_olmo": "FlexOlmoForCausalLM"}


def moe_family_of(dense_hf: dict[str, Any]) -> str:
    """The MoE family a dense config.json upcycles into; named errors otherwise."""
    mt = dense_hf.get("model_type")
    if mt in FAMILIES:
        raise ValueError(f"upcycle: the source is already an MoE model (model_type {mt!r}); "
                         f"upcycling starts from a dense model of {sorted(SIBLINGS)}")
    if mt not in SIBLINGS:
        raise ValueError(f"upcycle: model_type {mt!r} cannot be upcycled; supported dense "
                         f"families: {', '.join(f'{d} -> {m}' for d, m in SIBLINGS.items())}")
    return SIBLINGS[mt]


def _check_spec(spec: UpcycleSpec, family: str, n_layers: int) -> None:
    bad = [i for i in spec.mlp_only_layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"upcycle: mlp_only_layers {bad} are outside the {n_layers} layers")
    if family in _ALL_MOE and (spec.moe_every != 1 or spec.mlp_only_layers):
        raise ValueError(f"upcycle: {family} has no dense layers (no decoder_sparse_step or "
                         "mlp_only_layers): leave moe_every at 1 and mlp_only_layers empty")
    if family == "mixtral" and not spec.norm_topk_prob:
        raise ValueError("upcycle: Mixtral always renormalises its top-k weights "
                         "(norm_topk_prob cannot be turned off)")
    if spec.shared_expert and family != "qwen2_moe":
        raise ValueError(f"upcycle: shared_expert is Qwen2-MoE's; {family} has none")


def moe_config_json(dense_hf: dict[str, Any], spec: UpcycleSpec) -> dict[str, Any]:
    """The MoE family's config.json: the dense keys (attention, RoPE, norms, vocabulary,
    token ids, dtype) with the MoE keys of ``spec``; each expert is as wide as the MLP."""
    family = moe_family_of(dense_hf)
    HFDecoderConfig.from_hf(dense_hf)  # the dense model must itself be one moebit loads
    _check_spec(spec, family, int(dense_hf["num_hidden_layers"]))
    width = int(dense_hf["intermediate_size"])
    out = {k: v for k, v in dense_hf.items() if k not in _DROP_KEYS}
    out.update(model_type=family, architectures=[_ARCHS[family]],
               num_experts_per_tok=spec.num_experts_per_tok, output_router_logits=False,
               router_aux_loss_coef=spec.router_aux_loss_coef)
    if family == "mixtral":
        out.update(num_local_experts=spec.num_experts, router_jitter_noise=0.0,
                   sliding_window=None)
        return out
    if family == "flex_olmo":
        out.update(num_experts=spec.num_experts, norm_topk_prob=spec.norm_topk_prob)
        return out
    out.update(num_experts=spec.num_experts, moe_intermediate_size=width,
               decoder_sparse_step=spec.moe_every, mlp_only_layers=sorted(spec.mlp_only_layers),
               norm_topk_prob=spec.norm_topk_prob)
    if family == "qwen2_moe":
        out.update(qkv_bias=True, shared_expert_intermediate_size=width if spec.shared_expert else 0)
    else:  # Qwen3-MoE: q/k/v biases as the dense Qwen3; no per-layer attention types
        out.update(attention_bias=bool(dense_hf.get("attention_bias", False)))
        out.pop("layer_types", None)
    return out


def weights_sum_to_one(spec: UpcycleSpec, family: str) -> bool:
    """Whether a token's k weights sum to 1: renormalised top-k (Mixtral always)."""
    return family == "mixtral" or spec.norm_topk_prob


def preserves_dense_output(spec: UpcycleSpec, family: str) -> bool:
    """Whether the upcycled model computes the dense one's outputs."""
    return starts_at_dense(weights_sum_to_one(spec, family), spec.noise_std)


def _moe_layer_tensors(src: SafetensorsFolder, cfg: HFDecoderConfig, layer: int,
                       copier: ExpertCopier) -> dict[str, torch.Tensor]:
    """One MoE layer's router, experts (copies of the dense MLP) and shared expert."""
    dense = {}
    for n in _DENSE_MLP:
        name = f"model.layers.{layer}.mlp.{n}.weight"
        if name not in src:
            raise KeyError(f"upcycle: the dense checkpoint {src.folder} has no tensor {name}")
        dense[n] = src.read(name)
    i, h = cfg.intermediate_size, cfg.hidden_size
    want = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    for n, t in dense.items():
        if tuple(t.shape) != want[n]:
            raise ValueError(f"upcycle: model.layers.{layer}.mlp.{n}.weight has shape "
                             f"{tuple(t.shape)}, config.json implies {want[n]}")
    mixtral = cfg.model_type == "mixtral"
    prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    names = _EXPERT_NAMES.get(cfg.model_type, _DEFAULT_EXPERT_NAMES)
    scale = {"down_proj": 0.5} if cfg.shared_expert_intermediate_size else {}
    dtype = dense["gate_proj"].dtype
    out = {f"{prefix}.gate.weight": copier.router((cfg.num_experts, h), dtype)}
    stacked = {n: copier.experts((dense[n].float() * scale.get(n, 1.0)).to(dtype), cfg.num_experts)
               for n in _DENSE_MLP}
    for e in range(cfg.num_experts):
        for n, hf_n in zip(_DENSE_MLP, names, strict=True):
            out[f"{prefix}.experts.{e}.{hf_n}.weight"] = stacked[n][e].contiguous()
    if cfg.model_type == "qwen2_moe":
        shared = cfg.shared_expert_intermediate_size
        for n in _DENSE_MLP:
            t = dense[n] if shared else dense[n].new_empty((0, h) if n != "down_proj" else (h, 0))
            out[f"{prefix}.shared_expert.{n}.weight"] = t.clone()
        out[f"{prefix}.shared_expert_gate.weight"] = torch.zeros(1, h, dtype=dtype)
    return out


def _shards(src: SafetensorsFolder, cfg: HFDecoderConfig, spec: UpcycleSpec
            ) -> Iterator[dict[str, torch.Tensor]]:
    """Shard 1: every source tensor but the MoE layers' dense MLPs; then one per MoE layer."""
    consumed = {f"model.layers.{i}.mlp.{n}.weight" for i in cfg.moe_layers for n in _DENSE_MLP}
    yield {name: src.read(name) for name in sorted(src.where) if name not in consumed}
    copier = spec.copier()
    for layer in cfg.moe_layers:
        yield _moe_layer_tensors(src, cfg, layer, copier)


def upcycle_into(src: Path, out: Path, spec: UpcycleSpec) -> str:
    """Write the upcycled MoE model of the dense Hugging Face folder ``src`` into the empty
    folder ``out`` (the front end, ``moebit.upcycle.folders``, makes it atomic); returns
    the MoE family's name."""
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"upcycle: {src / 'config.json'} does not exist")
    dense_hf = json.loads((src / "config.json").read_text())
    moe_hf = moe_config_json(dense_hf, spec)
    cfg = HFDecoderConfig.from_hf(moe_hf)
    if not cfg.moe_layers:
        raise ValueError(f"upcycle: moe_every = {spec.moe_every} and mlp_only_layers = "
                         f"{spec.mlp_only_layers} leave no MoE layer in {cfg.num_layers} layers")
    warn_unless_dense(weights_sum_to_one(spec, cfg.model_type), spec.noise_std)
    _write_folder(SafetensorsFolder(src), cfg, spec, moe_hf, out)
    copy_side_files(src, out)  # tokenizer, chat template, generation config, ...
    return cfg.model_type


def _write_folder(reader: SafetensorsFolder, cfg: HFDecoderConfig, spec: UpcycleSpec,
                  moe_hf: dict[str, Any], folder: Path) -> None:
    """The shards, their index and config.json."""
    n = 1 + len(cfg.moe_layers)
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(_shards(reader, cfg, spec), start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (folder / "config.json").write_text(json.dumps(moe_hf, indent=2, sort_keys=True) + "\n")
