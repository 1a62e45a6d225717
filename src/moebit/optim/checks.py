"""Argument checks of moebit's optimizers: each error names the argument and what it must be."""

from __future__ import annotations

import math
from typing import Any


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str) -> None:
    """Adam-style hyper-parameters; ``where`` names the optimizer (and group) in errors."""
    if not _is_number(lr) or not lr >= 0.0:
        raise ValueError(f"{where}: invalid learning rate {lr!r} (must be a number >= 0)")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}") from None
    for i, b in enumerate((b1, b2)):
        if not _is_number(b) or not 0.0 <= b < 1.0:
            raise ValueError(f"{where}: invalid beta{i + 1} {b!r} (must be in [0, 1))")
    if not _is_number(eps) or not eps >= 0.0:
        raise ValueError(f"{where}: invalid eps {eps!r} (must be >= 0)")
    if not _is_number(weight_decay) or not weight_decay >= 0.0:
        raise ValueError(f"{where}: invalid weight_decay {weight_decay!r} (must be >= 0)")


def check_step_arg(name: str, value: Any, why: str, minimum: int = 1) -> int:
    """An int >= ``minimum`` (not a bool), or a ValueError naming ``name`` and ``why``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"invalid {name} {value!r}: expected an int >= {minimum} ({why})")
    return value


def check_range(name: str, value: Any, lo: float, hi: float | None = None,
                lo_open: bool = False) -> float:
    """A number in [lo, hi] (or (lo, hi] with ``lo_open``), or a ValueError naming it."""
    ok = _is_number(value) and math.isfinite(value) and (value > lo if lo_open else value >= lo)
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        left = "(" if lo_open else "["
        right = f"{hi}]" if hi is not None else "inf)"
        raise ValueError(f"invalid {name} {value!r}: must be a number in {left}{lo}, {right}")
    return float(value)
