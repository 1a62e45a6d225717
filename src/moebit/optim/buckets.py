"""Flat buffers of the compressed optimizers: one per (param group, device, dtype) "bucket",
with per-parameter views, so one collective compresses a whole bucket (one network round
trip instead of one per parameter) and writes the average back in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

CHUNK = 1 << 18  # elements per temporary in element-wise updates (1 MiB of fp32)


@dataclass
class Bucket:
    """Trainable params of one group sharing (device, dtype); each state buffer is one flat
    tensor (``flats[name]``) with one view per param (``views[name]``)."""

    name: str
    params: list[torch.Tensor]
    masks: list[torch.Tensor | None]
    flats: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    # The two buffers every optimizer of the family has.
    @property
    def exp_avg(self) -> torch.Tensor:
        return self.flats["exp_avg"]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.flats["exp_avg_sq"]

    @property
    def m_views(self) -> list[torch.Tensor]:
        return self.views["exp_avg"]

    @property
    def v_views(self) -> list[torch.Tensor]:
        return self.views["exp_avg_sq"]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """All tensors nested in dicts/lists/tuples (to count a compressor's error buffers)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def chunks(*tensors: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
    """Aligned pieces of at most ``CHUNK`` elements of same-shaped tensors (or the whole)."""
    first = tensors[0]
    if first.numel() > CHUNK and all(t.is_contiguous() for t in tensors):
        return zip(*(t.view(-1).split(CHUNK) for t in tensors), strict=True)
    return iter([tensors])


def copy_saved_buckets(saved: list[list[dict[str, torch.Tensor]]], buckets: list[list[Bucket]],
                       owner: str, add_flat: Any) -> None:
    """Copy a state_dict's flat buffers into freshly built buckets of the same layout
    (``add_flat(bucket, name)`` allocates a buffer only one stage had made)."""
    if len(saved) != len(buckets) or any(
        len(s) != len(b) for s, b in zip(saved, buckets, strict=True)
    ):
        raise ValueError(f"{owner} state_dict does not match these param groups")
    for s_group, b_group in zip(saved, buckets, strict=True):
        for s, b in zip(s_group, b_group, strict=True):
            for name, flat in s.items():
                if flat.numel() != b.numel:
                    raise ValueError(
                        f"{owner} state_dict bucket {b.name} holds {flat.numel()} "
                        f"elements, these params {b.numel}"
                    )
                target = b.flats.get(name)
                if target is None:
                    target = add_flat(b, name)
                target.copy_(flat)
