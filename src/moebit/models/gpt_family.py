"""moebit's byte-level GPT as a model family (``moebit.models.family.ModelFamily``).

Its config is ``GPTConfig``; its text is UTF-8 bytes (vocabulary 256); its checkpoints are
moebit run folders only (it has no Hugging Face folder form: ``moebit export`` refuses it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from moebit.models.family import Fits, LayerPattern
from moebit.models.gpt import GPT, GPTConfig, gpt_ep_groups, moe_config_for
from moebit.models.interface import CausalLM
from moebit.models.tokenizer import ByteTokenizer, Tokenizer
from moebit.models.upcycling import UpcycleSpec
from moebit.moe import MoEConfig

# what a student must share with its teacher to start from its weights
_SHAPE_KEYS = ("vocab_size", "d_model", "n_head", "d_ffn", "block_size")


def _student_is_moe(cfg: GPTConfig, n_layer: int) -> list[bool]:
    """Which blocks of an ``n_layer`` student are MoE: the teacher's ``moe_every`` rule."""
    return [cfg.is_moe and (i + 1) % cfg.moe_every == 0 for i in range(n_layer)]


@dataclasses.dataclass(frozen=True)
class GPTFamily:
    name: str = "gpt"

    def owns(self, cfg: Any) -> bool:
        return isinstance(cfg, GPTConfig)

    def owns_dict(self, d: dict[str, Any]) -> bool:
        return "model_type" not in d and "n_layer" in d

    def owns_folder(self, path: Path) -> bool:
        return False  # moebit's GPT lives in run folders, read through their manifests

    def config_from_dict(self, d: dict[str, Any]) -> GPTConfig:
        return GPTConfig(**d)

    def read_folder_config(self, path: Path, ep_size: int = 1) -> GPTConfig:
        raise ValueError(f"{path}: moebit's GPT has no model-folder form (it is trained from "
                         "scratch, or resumed from a run folder)")

    def pattern(self, cfg: GPTConfig) -> LayerPattern:
        return LayerPattern(cfg.n_layer, tuple(cfg.experts_at(i) for i in range(cfg.n_layer)),
                            cfg.moe.ep_size if cfg.moe is not None else 1)

    def with_ep_size(self, cfg: GPTConfig, ep_size: int) -> GPTConfig:
        if cfg.moe is None:
            if ep_size > 1:
                raise ValueError(f"a dense model: expert parallelism (ep_size {ep_size}) needs experts")
            return cfg
        return dataclasses.replace(cfg, moe=cfg.moe.replace(ep_size=ep_size))

    def moe(self, cfg: GPTConfig) -> MoEConfig | None:
        return cfg.moe  # type: ignore[return-value]

    def check(self, cfg: GPTConfig) -> None:
        """Every MoE block's own settings (its expert count against top-k, divisibility)."""
        for layer in cfg.moe_layers():
            try:
                moe_config_for(cfg, layer)
            except ValueError as e:
                raise ValueError(f"MoE layer {layer}: {e}") from None

    def build(self, cfg: GPTConfig, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None) -> CausalLM:
        if str(device) == "meta":
            groups = gpt_ep_groups(cfg) if cfg.moe is not None and cfg.moe.ep_size > 1 else None
            with torch.device("meta"):
                model = GPT(cfg, ep_groups=groups)
        else:
            model = GPT(cfg).to(device)
        return model.to(dtype) if dtype is not None else model

    def load_folder(self, cfg: GPTConfig, path: Path, dtype: torch.dtype | None = None) -> CausalLM:
        raise ValueError(f"{path}: moebit's GPT loads weights from run checkpoints only")

    def save_folder(self, model: CausalLM, out: Path) -> Path:
        raise ValueError("this run holds a moebit GPT; export writes Hugging Face families only "
                         "(train with --init-from HF_DIR)")

    def stored_dtype(self, cfg: GPTConfig) -> torch.dtype | None:
        return None  # its checkpoints keep the training dtype (float32)

    def upcycle_folder(self, src: Path, out: Path, spec: UpcycleSpec) -> str:
        raise ValueError("moebit's GPT upcycles run folders (moebit.upcycle.runs), not model folders")

    def tokenizer(self, source: Path | None) -> Tokenizer:
        return ByteTokenizer()

    def student_fits(self, cfg: GPTConfig, n_student: int) -> Fits:
        t_moe = [cfg.experts_at(j) > 0 for j in range(cfg.n_layer)]
        s_moe = _student_is_moe(cfg, n_student)
        return lambda i, j: t_moe[j] == s_moe[i]

    def misfit(self, cfg: GPTConfig, keep: list[int], i: int, k: int) -> str:
        want = "an MoE" if _student_is_moe(cfg, len(keep))[i] else "a dense"
        return (f"--keep-layers {keep}: student block {i} is {want} block (moe_every="
                f"{cfg.moe_every}) but teacher block {k} is not; the dense/MoE kinds must match")

    def max_student_layers(self, cfg: GPTConfig) -> int:
        return cfg.n_layer

    def student_config(self, cfg: GPTConfig, keep: list[int]) -> GPTConfig:
        """The teacher's configuration with only the ``keep`` blocks (their expert counts)."""
        counts = [cfg.experts_at(k) for k in keep if cfg.experts_at(k) > 0]
        d = cfg.to_dict()
        d["n_layer"] = len(keep)
        if not counts:
            d["num_experts"], d["moe"] = 0, None
        elif isinstance(cfg.num_experts, int):
            d["num_experts"] = cfg.num_experts
        else:
            d["num_experts"] = counts
        return GPTConfig(**d)

    def student_shape(self, cfg: GPTConfig) -> dict[str, Any]:
        """What a student shares with its teacher: widths, vocabulary, context, and whether
        its MoE blocks are Residual MoE."""
        out = {k: getattr(cfg, k) for k in _SHAPE_KEYS}
        if cfg.is_moe:
            out["residual MoE"] = bool(cfg.moe and cfg.moe.residual)
        return out


GPT_FAMILY = GPTFamily()
