"""The one place a model is built from a configuration (training, distillation, resume).

New families (a later issue's Hugging Face models) add their config type here; everything
after this call sees only the ``CausalLM`` interface.
"""

from __future__ import annotations

from typing import Any, Protocol

from moebit.models.gpt import GPT, GPTConfig
from moebit.models.hf import HFDecoder, HFDecoderConfig, build_empty, load_hf_weights
from moebit.models.interface import CausalLM


class HasModelConfig(Protocol):
    def model_config(self) -> Any: ...


def build_model(cfg: HasModelConfig) -> CausalLM:
    """The model ``cfg.model_config()`` describes, freshly initialised from torch's RNG
    (a Hugging Face config with ``cfg.init_from``: that folder's weights)."""
    mcfg = cfg.model_config()
    if isinstance(mcfg, GPTConfig):
        return GPT(mcfg)
    if isinstance(mcfg, HFDecoderConfig):  # a Hugging Face family: its weights when given
        init = getattr(cfg, "init_from", None)
        if not init:
            return HFDecoder(mcfg)
        model = build_empty(mcfg)
        load_hf_weights(model, init)
        return model
    raise TypeError(f"build_model: no model family for a {type(mcfg).__name__} configuration")
