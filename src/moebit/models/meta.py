"""Build modules on the meta device without running their initializers.

A meta tensor has no values, yet ``nn.Embedding``'s ``normal_`` (and other initializers)
still dispatch to torch's Python reference implementations on it, and those import
``torch._dynamo``: seconds of a launcher's start (the memory check builds the model on
meta) for numbers nobody reads. ``on_meta()`` is ``torch.device("meta")`` that returns
the meta tensor untouched from every in-place initializer: for callers that want shapes
only. ``ModelFamily.build(cfg, device="meta")`` itself keeps its initializers, since a
sharded run records that build's operations to replay them per rank
(``moebit.training.meta_init``) and the draws are what it replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# In-place initializers: torch.nn.init's and the Tensor methods they call.
_INITIALIZERS = frozenset({
    "normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "constant_", "zeros_",
    "ones_", "eye_", "dirac_", "zero_", "fill_", "copy_", "exponential_", "bernoulli_",
})


class _NoInitOnMeta(TorchFunctionMode):
    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INITIALIZERS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules made inside get meta parameters and buffers; initializers are skipped."""
    with torch.device("meta"), _NoInitOnMeta():
        yield

