"""What one rank holds: parameter, gradient and optimizer-state bytes, and peak RSS.

Sharding's point is that these fall as 1/world; measuring them per rank (rather than
trusting the arithmetic) catches a tensor that was left replicated. DTensors count
their local shard only (FSDP's padding included), a tensor shared by two parameters
(tied embeddings) counts once.
"""

from __future__ import annotations

import re
import resource
import sys
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        t = _local(t)
        key = (t.data_ptr(), t.numel())  # views of one buffer (FSDP's grads) are distinct
        if not t.numel() or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def state_bytes_per_rank(model: nn.Module,
                         optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """Bytes of this rank's parameters, their gradients (those present now) and the
    optimizer's state tensors (after its first step; Adam: exp_avg, exp_avg_sq, step)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states: list[torch.Tensor] = []
    if optimizer is not None:
        for s in optimizer.state.values():
            states.extend(v for v in s.values() if isinstance(v, torch.Tensor))
    return StateBytes(_bytes(params, set()), _bytes(grads, set()), _bytes(states, set()))


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (``getrusage``: KiB on Linux, bytes
    on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def size_bytes(text: str, what: str) -> int:
    """Bytes of ``24GiB``, ``1.5GB``, ``512MiB`` or a plain number; else a ValueError
    naming ``what`` (the flag)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"{what}: expected a size such as 24GiB, 1.5GB or 512MiB (got {text!r})")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{what}: must be positive (got {text!r})")
    return value


class LiveTensorBytes:
    """The most bytes of CPU tensor storage alive at once while it is entered, counted
    over every tensor any torch operation read or made in that time (a DTensor by its
    local shard). It watches the operations themselves (a dispatch mode), so it measures
    what a build really allocated, whatever code did it: ``peak`` against the model's
    bytes tells whether some rank held the full model.

        with LiveTensorBytes() as live:
            model = build()
        live.peak
    """

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self
        self.peak = 0
        self._seen: dict[int, tuple[StorageWeakRef, int]] = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                meter._note(args, kwargs, out, StorageWeakRef)
                return out

        self._mode = _Mode()

    def _note(self, args: object, kwargs: object, out: object, weak: type) -> None:
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten((args, kwargs, out))[0]:
            if not isinstance(t, torch.Tensor):
                continue
            t = _local(t)
            if t.device.type != "cpu":
                continue
            s = t.untyped_storage()
            held = self._seen.get(s._cdata)
            if held is None or held[0].expired():
                self._seen[s._cdata] = (weak(s), s.nbytes())
        live = 0
        for key, (ref, n) in list(self._seen.items()):
            if ref.expired():
                del self._seen[key]
            else:
                live += n
        self.peak = max(self.peak, live)

    def __enter__(self) -> LiveTensorBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
