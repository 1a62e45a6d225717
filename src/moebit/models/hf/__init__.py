"""Hugging Face MoE checkpoints in moebit: load, train, generate, save back.

    from moebit.models.hf import from_pretrained, save_pretrained
    model = from_pretrained("path/to/mixtral")                 # an HFDecoder (CausalLM)
    model = from_pretrained(path, ep_size=2, rank=r)           # this rank reads its experts only
    save_pretrained(model, "out/")                             # transformers loads "out/"

Families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ..., DeepSeek-V3/V2 (docs/huggingface.md). Only local folders
are read (``config.json`` + safetensors); nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from moebit.comm import collectives
from moebit.models.hf.config import FAMILIES, HFDecoderConfig, read_config
from moebit.models.hf.decoder import HFDecoder
from moebit.models.hf.weights import LoadReport, load_hf_weights, write_shards
from moebit.models.meta import on_meta
from moebit.moe import expert_parallel_groups

__all__ = ["FAMILIES", "HFDecoder", "HFDecoderConfig", "LoadReport", "build_empty",
           "from_pretrained", "is_hf_folder", "load_hf_weights", "read_config", "save_pretrained"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder: a config.json with a model_type, and safetensors."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    try:
        has_type = "model_type" in json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, OSError):
        return False
    return has_type and ((p / "model.safetensors").is_file()
                         or (p / "model.safetensors.index.json").is_file())


def build_empty(cfg: HFDecoderConfig, dtype: torch.dtype = torch.float32) -> HFDecoder:
    """An ``HFDecoder`` with uninitialised weights: built on the meta device (no random
    init of billions of expert weights only to overwrite them), then given real storage.
    The expert-parallel groups are made first, outside the meta device."""
    groups = expert_parallel_groups(cfg.ep_size) if cfg.is_moe and cfg.ep_size > 1 else None
    with on_meta():
        model = HFDecoder(cfg, ep_groups=groups)
    model.to_empty(device="cpu")  # the rotary frequencies are recomputed here, in float32
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.wte.weight
    return model.to(dtype)


def dtype_of(dtype: torch.dtype | str | None, cfg: HFDecoderConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.float32
    name = (cfg.hf.get("dtype") or cfg.hf.get("torch_dtype") or "float32") if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)} (or 'auto')")
    return _DTYPES[name]


def from_pretrained(path: str | Path, ep_size: int = 1, rank: int = 0,
                    dtype: torch.dtype | str | None = None) -> HFDecoder:
    """Build the model of a local Hugging Face folder and load its safetensors weights.

    ``ep_size > 1`` splits every MoE layer's experts over that many ranks (the process
    group must be up; call on every rank): this rank holds and reads only the experts of
    ``rank % ep_size`` (``rank`` is this process's global rank; it must match it).
    ``dtype``: None = float32, "auto" = the checkpoint's ``dtype``, or a torch dtype.
    Returns the model in eval mode.
    """
    cfg = read_config(path, ep_size)
    if ep_size > 1 and collectives.rank() != rank:
        raise ValueError(f"rank = {rank} but this process is rank {collectives.rank()}")
    model = build_empty(cfg, dtype_of(dtype, cfg))
    load_hf_weights(model, path)
    return model.eval()


def save_pretrained(model: HFDecoder, path: str | Path) -> Path:
    """Write ``model`` as a folder transformers loads: ``config.json`` and sharded
    safetensors with ``model.safetensors.index.json`` (per-expert layout).

    Expert parallel: call on every rank; each expert shard is written by the first rank
    holding it (no gather of the experts), the rest by rank 0, then all ranks wait.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    me = collectives.rank()
    ep_rank = me % cfg.ep_size if model.ep_groups is not None else 0
    first_replica = me < (cfg.ep_size if model.ep_groups is not None else 1)
    if first_replica:
        write_shards(model, out, ep_rank, write_dense=me == 0)
    if me == 0:
        dtype = str(model.wte.weight.dtype).removeprefix("torch.")
        hf = cfg.to_hf(dtype=dtype)
        hf.setdefault("architectures", [_ARCHS[cfg.model_type]])
        (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if collectives.world_size() > 1:
        dist.barrier()  # every shard is on disk before any rank reads the folder
    return out


_ARCHS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
          "flex_olmo": "FlexOlmoForCausalLM", "llama": "LlamaForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
          "glm4_moe": "Glm4MoeForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
          "gpt_oss": "GptOssForCausalLM",
          "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
