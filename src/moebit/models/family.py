"""What a model family is to the rest of moebit: one object answering every question that
training, checkpoints, decoding, distillation, upcycling and export ask of a family.

The loop and the tools never switch on a model's type: they ask the registry
(``moebit.models.registry``) for the family of a config, a manifest or a folder, and then
ask the family. Adding a family is one object implementing ``ModelFamily`` plus its blocks,
registered with ``register``.

The facts every family shares are spelled once, in ``LayerPattern``: how many layers,
which are MoE, how many experts each has, and over how many ranks the experts are split.

    fam = family_of(cfg)                     # cfg: any family's model config
    fam.pattern(cfg).moe_layers              # [1, 3]
    model = fam.build(cfg)                   # a CausalLM, random init (or device="meta")
    tok = fam.tokenizer(source)              # bytes for moebit's GPT, tokenizer.json for HF
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from moebit.models.interface import CausalLM
from moebit.models.tokenizer import Tokenizer
from moebit.moe import MoEConfig


@dataclass(frozen=True)
class LayerPattern:
    """The layer facts of a model config, in one spelling for every family."""

    num_layers: int
    experts: tuple[int, ...]  # experts of each layer; 0 for a dense layer
    ep_size: int = 1  # the experts of every MoE layer are split over this many ranks

    def __post_init__(self) -> None:
        if len(self.experts) != self.num_layers:
            raise ValueError(f"LayerPattern: {len(self.experts)} expert counts for "
                             f"{self.num_layers} layers")

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, e in enumerate(self.experts) if e > 0]

    @property
    def is_moe(self) -> bool:
        return any(self.experts)

    @property
    def expert_counts(self) -> list[int]:
        """The expert count of each MoE layer, in layer order."""
        return [e for e in self.experts if e > 0]

    def experts_at(self, layer: int) -> int:
        return self.experts[layer]


# student layer i may start from teacher layer j
Fits = Callable[[int, int], bool]


@runtime_checkable
class ModelFamily(Protocol):
    """One model family. Methods take and return the family's own config object (a
    dataclass with ``to_dict()``); ``owns`` tells which configs, manifests and folders are
    the family's, so the registry can route them."""

    name: str

    # -- which configs, manifests and folders are this family's
    def owns(self, cfg: Any) -> bool: ...

    def owns_dict(self, d: dict[str, Any]) -> bool: ...

    def owns_folder(self, path: Path) -> bool: ...

    # -- config in and out
    def config_from_dict(self, d: dict[str, Any]) -> Any: ...

    def read_folder_config(self, path: Path, ep_size: int = 1) -> Any: ...

    def pattern(self, cfg: Any) -> LayerPattern: ...

    def with_ep_size(self, cfg: Any, ep_size: int) -> Any: ...

    def moe(self, cfg: Any) -> MoEConfig | None: ...

    def check(self, cfg: Any) -> None: ...

    # -- build, weights in and out
    def build(self, cfg: Any, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None) -> CausalLM: ...

    def load_folder(self, cfg: Any, path: Path, dtype: torch.dtype | None = None) -> CausalLM: ...

    def save_folder(self, model: CausalLM, out: Path) -> Path: ...

    def stored_dtype(self, cfg: Any) -> torch.dtype | None: ...

    # -- text
    def tokenizer(self, source: Path | None) -> Tokenizer: ...

    # -- Mixture-of-Students: which teacher layer may start which student layer
    def student_fits(self, cfg: Any, n_student: int) -> Fits: ...

    def misfit(self, cfg: Any, keep: list[int], i: int, k: int) -> str: ...

    def max_student_layers(self, cfg: Any) -> int: ...

    def student_config(self, cfg: Any, keep: list[int]) -> Any: ...

    def student_shape(self, cfg: Any) -> dict[str, Any]: ...
