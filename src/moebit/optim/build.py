"""Build an optimizer by name, or from a DeepSpeed-style ``{"optimizer": ...}`` config.

One registry maps a name to a factory with a common keyword signature, so the CLI,
config files and DeepSpeed JSON all go through the same place, and adding an optimizer
is one entry in ``_REGISTRY`` (plus one in ``_DEEPSPEED_TYPES`` for its DeepSpeed name).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from moebit.optim.onebit_adam import OnebitAdam

logger = logging.getLogger("moebit.optim")

ParamGroups = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
Factory = Callable[..., Optimizer]


def _adam(
    param_groups: ParamGroups,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    freeze_step: int | str | None,
    process_group: dist.ProcessGroup | None,
    decoupled: bool = True,
) -> Optimizer:
    """torch's AdamW when there is weight decay (decoupled, as OnebitAdam), else Adam.

    Extra group keys such as ``process_group`` are kept in the groups and ignored by
    torch: the training loop averages the gradients of each group before ``step``.
    """
    if freeze_step is not None:
        logger.warning("freeze_step=%r ignored: plain Adam has no compression stage", freeze_step)
    cls = torch.optim.AdamW if weight_decay and decoupled else torch.optim.Adam
    return cls(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _onebit_adam(
    param_groups: ParamGroups,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    freeze_step: int | str | None,
    process_group: dist.ProcessGroup | None,
    **extra: Any,
) -> Optimizer:
    kwargs: dict[str, Any] = dict(extra)
    if freeze_step is not None:
        kwargs["freeze_step"] = freeze_step
    return OnebitAdam(
        param_groups,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        process_group=process_group,
        **kwargs,
    )


_REGISTRY: dict[str, Factory] = {
    "adam": _adam,
    "onebit_adam": _onebit_adam,
}


def register_optimizer(name: str, factory: Factory) -> None:
    """Add ``name`` -> ``factory(param_groups, *, lr, betas, eps, weight_decay,
    freeze_step, process_group, **extra)``."""
    _REGISTRY[name] = factory


def optimizer_names() -> list[str]:
    return sorted(_REGISTRY)


def build_optimizer(
    name: str,
    param_groups: ParamGroups,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    **extra: Any,
) -> Optimizer:
    """The optimizer registered as ``name``.

    ``freeze_step``: None keeps the optimizer's default (``"auto"`` for onebit_adam); an
    int or ``"auto"`` otherwise. ``extra`` goes to the factory (e.g. OnebitAdam's
    ``grads_averaged_externally``/``ddp_hook_state`` under DDP).
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(optimizer_names())}")
    return factory(
        param_groups,
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        freeze_step=freeze_step,
        process_group=process_group,
        **extra,
    )


# DeepSpeed "type" (lower-cased, as DeepSpeed compares it) -> (registry name, params
# accepted with DeepSpeed's defaults). Keys absent from a config take these defaults.
_COMMON = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_DEEPSPEED_TYPES: dict[str, tuple[str, dict[str, Any]]] = {
    "adam": ("adam", {**_COMMON, "amsgrad": False, "torch_adam": False, "adam_w_mode": True}),
    "adamw": ("adam", {**_COMMON, "amsgrad": False, "torch_adam": False, "adam_w_mode": True}),
    "onebitadam": (
        "onebit_adam",
        {
            **_COMMON,
            "freeze_step": 100000,
            "bias_correction": True,
            "eps_inside_sqrt": False,
            "max_grad_norm": 0.0,
            "amsgrad": False,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    ),
}
# Accepted for compatibility; they select DeepSpeed transports or kernels moebit does not need.
_NOT_NEEDED = {"cuda_aware", "comm_backend_name", "torch_adam"}


def optimizer_from_deepspeed_config(
    cfg: dict[str, Any],
    param_groups: ParamGroups,
    *,
    process_group: dist.ProcessGroup | None = None,
    **extra: Any,
) -> Optimizer:
    """Build from ``{"optimizer": {"type": "OneBitAdam", "params": {...}}}``.

    DeepSpeed's parameter names and defaults (``freeze_step`` defaults to 100000 as in
    DeepSpeed: set it, or "auto"). Keys of the config other than "optimizer" are ignored
    here (they belong to other parts). Unknown params raise ValueError naming them.
    """
    if "optimizer" not in cfg:
        raise ValueError("DeepSpeed config has no 'optimizer' section")
    section = cfg["optimizer"]
    unknown = sorted(set(section) - {"type", "params"})
    if unknown:
        raise ValueError(f"unknown keys in DeepSpeed 'optimizer' section: {', '.join(unknown)}")
    ds_type = str(section.get("type", ""))
    entry = _DEEPSPEED_TYPES.get(ds_type.lower())
    if entry is None:
        raise ValueError(
            f"unsupported DeepSpeed optimizer type {ds_type!r}; supported: "
            + ", ".join(sorted(_DEEPSPEED_TYPES))
        )
    name, defaults = entry
    given = dict(section.get("params") or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"unknown params for DeepSpeed optimizer {ds_type!r}: {', '.join(unknown)} "
            f"(accepted: {', '.join(sorted(defaults))})"
        )
    p = {**defaults, **given}
    for key in sorted(_NOT_NEEDED & set(given)):
        logger.info(
            "DeepSpeed optimizer param %r=%r accepted but not needed: moebit runs on any "
            "torch.distributed backend (gloo, NCCL, MPI) without special transports",
            key, given[key],
        )
    if p["amsgrad"]:
        raise ValueError("amsgrad=True is not supported by moebit's DeepSpeed mapping")
    kwargs: dict[str, Any] = dict(
        lr=float(p["lr"]),
        betas=tuple(p["betas"]),
        eps=float(p["eps"]),
        weight_decay=float(p["weight_decay"]),
        process_group=process_group,
    )
    if name == "adam":
        return build_optimizer(
            name, param_groups, decoupled=bool(p["adam_w_mode"]) or ds_type.lower() == "adamw",
            **kwargs, **extra,
        )
    if p["eps_inside_sqrt"]:
        raise ValueError("eps_inside_sqrt=True is not supported: eps is added outside sqrt(v)")
    if p["max_grad_norm"]:
        raise ValueError(
            "max_grad_norm is not applied by the optimizer (DeepSpeed ignores it too): clip "
            "gradients in the training loop instead"
        )
    if "freeze_step" not in given:
        logger.info("DeepSpeed OneBitAdam without freeze_step: using DeepSpeed's default 100000")
    return build_optimizer(
        name, param_groups, freeze_step=p["freeze_step"],
        bias_correction=bool(p["bias_correction"]), **kwargs, **extra,
    )
