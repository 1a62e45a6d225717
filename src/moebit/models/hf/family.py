"""The Hugging Face decoder families as model families (``moebit.models.family``).

One ``HFFamily`` object per ``model_type`` (Mixtral, Qwen2-MoE, ...; their dense parents
Llama, Qwen2, ...): they share the decoder (``decoder.py``), the config mapping
(``config.py``) and the safetensors reader/writer (``weights.py``), and differ in what the
config mapping knows of each. Their text is the folder's ``tokenizer.json``.

A student keeps the teacher's ``config.json`` with fewer layers: the student follows the
teacher's pattern rule (``decoder_sparse_step``, ``first_k_dense_replace``) at its own
depth, a dense slot taking a dense teacher layer and an MoE slot an MoE layer, or one of
the teacher's ``mlp_only_layers`` (dense by exception), which then becomes one of the
student's ``mlp_only_layers``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from moebit.models.family import Fits, LayerPattern
from moebit.models.hf import build_empty, dtype_of, is_hf_folder, load_hf_weights, save_pretrained
from moebit.models.hf.config import DENSE_FAMILIES, FAMILIES, HFDecoderConfig, read_config
from moebit.models.hf.decoder import HFDecoder, moe_config_for
from moebit.models.hf.tokens import TOKENIZER_FILE
from moebit.models.hf.upcycle import upcycle_into
from moebit.models.interface import CausalLM
from moebit.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from moebit.models.upcycling import UpcycleSpec
from moebit.moe import MoEConfig, expert_parallel_groups

# HFDecoderConfig fields a student may differ in from its teacher (depth and its pattern,
# gpt-oss's per-layer attention kinds, which follow the kept layers, the source dict, and
# the run's own sequence length and expert parallelism)
_FREE_FIELDS = ("num_layers", "moe_layers", "hf", "ep_size", "block_size", "layer_types")


def rule_is_moe(cfg: HFDecoderConfig, n_layers: int) -> list[bool]:
    """The family's regular pattern at depth ``n_layers``: every ``decoder_sparse_step``-th
    layer from ``first_k_dense_replace`` on is MoE (before ``mlp_only_layers``)."""
    step = int(cfg.hf.get("decoder_sparse_step", 1) or 1)
    first = int(cfg.hf.get("first_k_dense_replace", 0) or 0)
    return [cfg.num_experts > 0 and (i + 1) % step == 0 and i >= first for i in range(n_layers)]


def student_hf_dict(cfg: HFDecoderConfig, keep: list[int]) -> dict[str, Any]:
    """The student's ``config.json``: the teacher's with ``num_hidden_layers``, the
    per-layer lists and ``mlp_only_layers`` rewritten for the kept layers."""
    out = dict(cfg.hf)
    out["num_hidden_layers"] = len(keep)
    for key in ("layer_types",):  # per-layer lists follow their layers
        if isinstance(out.get(key), list):
            out[key] = [out[key][k] for k in keep]
    rule = rule_is_moe(cfg, len(keep))
    dense = [i for i, k in enumerate(keep) if rule[i] and k not in cfg.moe_layers]
    if "mlp_only_layers" in out or dense:
        out["mlp_only_layers"] = dense
    if "max_window_layers" in out:  # Qwen: layers below it would use a sliding window
        out["max_window_layers"] = min(int(out["max_window_layers"]), len(keep))
    return out


@dataclasses.dataclass(frozen=True)
class HFFamily:
    name: str  # the config.json model_type

    def owns(self, cfg: Any) -> bool:
        return isinstance(cfg, HFDecoderConfig) and cfg.model_type == self.name

    def owns_dict(self, d: dict[str, Any]) -> bool:
        return d.get("model_type") == self.name

    def owns_folder(self, path: Path) -> bool:
        if not is_hf_folder(path):
            return False
        try:
            cfg = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError):
            return False  # an unreadable config.json: the folder checks name the problem
        return isinstance(cfg, dict) and cfg.get("model_type") == self.name

    def config_from_dict(self, d: dict[str, Any]) -> HFDecoderConfig:
        return HFDecoderConfig.from_dict(d)

    def read_folder_config(self, path: Path, ep_size: int = 1) -> HFDecoderConfig:
        return read_config(path, ep_size)

    def pattern(self, cfg: HFDecoderConfig) -> LayerPattern:
        experts = tuple(cfg.num_experts if i in cfg.moe_layers else 0 for i in range(cfg.num_layers))
        return LayerPattern(cfg.num_layers, experts, cfg.ep_size)

    def with_ep_size(self, cfg: HFDecoderConfig, ep_size: int) -> HFDecoderConfig:
        if not cfg.is_moe and ep_size > 1:
            raise ValueError(f"a dense model: expert parallelism (ep_size {ep_size}) needs experts")
        return cfg.replace(ep_size=ep_size if cfg.is_moe else 1)

    def moe(self, cfg: HFDecoderConfig) -> MoEConfig | None:
        return moe_config_for(cfg) if cfg.is_moe else None

    def check(self, cfg: HFDecoderConfig) -> None:
        """Nothing beyond what reading the config.json checked."""

    def build(self, cfg: HFDecoderConfig, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None) -> CausalLM:
        if str(device) == "meta":
            groups = expert_parallel_groups(cfg.ep_size) if cfg.is_moe and cfg.ep_size > 1 else None
            with torch.device("meta"):
                model = HFDecoder(cfg, ep_groups=groups)
        else:
            model = HFDecoder(cfg).to(device)
        return model.to(dtype) if dtype is not None else model

    def load_folder(self, cfg: HFDecoderConfig, path: Path,
                    dtype: torch.dtype | None = None) -> CausalLM:
        """Built on the meta device, given real storage, then filled from the safetensors
        (no random init of every expert only to overwrite it)."""
        model = build_empty(cfg, dtype or torch.float32)
        load_hf_weights(model, path)
        return model

    def save_folder(self, model: CausalLM, out: Path) -> Path:
        return save_pretrained(model, out)  # type: ignore[arg-type]

    def stored_dtype(self, cfg: HFDecoderConfig) -> torch.dtype | None:
        """The dtype config.json says the weights were saved in (``dtype``/``torch_dtype``)."""
        return dtype_of("auto", cfg)

    def upcycle_folder(self, src: Path, out: Path, spec: UpcycleSpec) -> str:
        """Llama -> Mixtral, Qwen2 -> Qwen2-MoE, Qwen3 -> Qwen3-MoE, OLMo2 -> FlexOlmo."""
        return upcycle_into(src, out, spec)

    def tokenizer(self, source: Path | None) -> Tokenizer:
        """The folder's tokenizer.json; without one, bytes (where the vocabulary covers them)."""
        if source is not None and (Path(source) / TOKENIZER_FILE).is_file():
            return HFTokenizer.from_folder(source)
        return ByteTokenizer()

    def student_fits(self, cfg: HFDecoderConfig, n_student: int) -> Fits:
        """Kinds match, or teacher layer j is one of the teacher's ``mlp_only_layers``
        (dense where the rule says MoE) and fills a slot the rule makes MoE."""
        t_moe = [j in cfg.moe_layers for j in range(cfg.num_layers)]
        t_rule = rule_is_moe(cfg, cfg.num_layers)
        s_rule = rule_is_moe(cfg, n_student)
        mlp_only = [t_rule[j] and not t_moe[j] for j in range(cfg.num_layers)]
        return lambda i, j: t_moe[j] == s_rule[i] or (s_rule[i] and mlp_only[j])

    def misfit(self, cfg: HFDecoderConfig, keep: list[int], i: int, k: int) -> str:
        if rule_is_moe(cfg, len(keep))[i]:
            return (f"--keep-layers {keep}: student layer {i} is an MoE layer by the family's "
                    f"pattern but teacher layer {k} is dense")
        return (f"--keep-layers {keep}: student layer {i} is dense by the family's pattern "
                f"(decoder_sparse_step / first_k_dense_replace) but teacher layer {k} is MoE")

    def max_student_layers(self, cfg: HFDecoderConfig) -> int:
        return cfg.num_layers - 1  # a student of the teacher's own depth is the teacher

    def student_config(self, cfg: HFDecoderConfig, keep: list[int]) -> HFDecoderConfig:
        return HFDecoderConfig.from_hf(student_hf_dict(cfg, keep), ep_size=cfg.ep_size)

    def student_shape(self, cfg: HFDecoderConfig) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _FREE_FIELDS}


HF_FAMILIES = tuple(HFFamily(t) for t in FAMILIES + DENSE_FAMILIES)
