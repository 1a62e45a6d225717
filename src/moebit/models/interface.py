"""The model interface: what the loop, checkpoints, distillation, eval and decoding rely on.

Any ``nn.Module`` with these members plugs into ``moebit.training.loop``: moebit's byte GPT
(``models.gpt``) implements it, and so do the Hugging Face families. It is a Protocol, not
a base class: a model satisfies it by shape, and ``isinstance(model, CausalLM)`` checks
the members exist.

    out = model(input_ids_BT, targets_BT)   # ModelOutput: logits, loss, aux_loss, ffn_outputs
    cache = model.new_cache(batch, max_len, starts)       # decoding: a models.kv_cache.KVCache
    out = model(next_ids_BT, cache=cache, logits_to_keep=1)
    out = model(packed_1N, cache=ragged_view, logits_to_keep=index_K)   # serving: see below

``cache`` is whatever the caller made (``new_cache``'s ``KVCache``, serving's slot cache or
its ragged view, ``serve.ragged.RaggedView``). A model asks it only: ``longest(t)``,
``positions(t, limit)``, ``attend(layer, q, k, v)`` (writes the new keys/values and
returns the attention), ``ffn_rows(t)`` (the tokens the feed-forward runs on) and
``advance(t)``. ``logits_to_keep`` is an int (the last n columns; 0: all) or, as in
transformers, a 1-D tensor of the column indices to keep (a ragged batch's last tokens).
The packed ragged call is opt-in: a model sets ``supports_ragged = True`` when its
attention goes only through ``cache.attend`` and it takes an index tensor as
``logits_to_keep``; the server runs any other model with one decode forward and separate
prompt forwards over a plain slot cache.
    model.num_params(), model.num_expert_params()
    is_expert_param(p)                      # the one way to tell an expert parameter
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from moebit.moe import is_expert_param

__all__ = ["CausalLM", "ModelOutput", "device_of", "is_expert_param", "keep_columns"]


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None  # mean cross-entropy in nats per token, when targets are given
    aux_loss: torch.Tensor  # sum of the feed-forwards' auxiliary losses (0 for dense)
    ffn_outputs: list[Any]  # each block's feed-forward output (router stats live there)


@runtime_checkable
class CausalLM(Protocol):
    config: Any  # a dataclass with to_dict(); saved in every checkpoint manifest
    blocks: nn.ModuleList  # decoder blocks, driven one by one by decoding
    ep_groups: Any  # moebit.moe.EPGroups when experts are sharded over ranks, else None

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                cache: Any = None, logits_to_keep: int | torch.Tensor = 0) -> ModelOutput: ...

    def new_cache(self, batch: int, max_len: int,
                  starts: Sequence[int] | None = None) -> Any: ...

    def num_params(self) -> int: ...

    def num_expert_params(self) -> int: ...


def keep_columns(x_BTD: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The columns whose logits a forward returns: the last ``logits_to_keep`` (0: all),
    or the columns a 1-D index tensor names (a packed batch keeps each row's last token,
    so the LM head, the widest matmul, runs on those rows only)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return x_BTD.index_select(1, logits_to_keep.to(x_BTD.device))
    return x_BTD[:, -logits_to_keep:] if logits_to_keep else x_BTD


def keeps_all(logits_to_keep: int | torch.Tensor) -> bool:
    """Whether a forward returns every column's logits (the loss needs them)."""
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def device_of(model: nn.Module) -> torch.device:
    """Where a model's input ids go: the device of its first parameter (decoding and serving
    build their id tensors there without knowing the family's embedding's name)."""
    return next(model.parameters()).device
