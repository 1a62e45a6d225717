"""Build an optimizer by name, or from a DeepSpeed-style ``{"optimizer": ...}`` config.

One registry maps a name to a factory with a common keyword signature, so the CLI,
config files and DeepSpeed JSON all go through the same place, and adding an optimizer
is one entry in ``_REGISTRY`` (plus one in ``_DEEPSPEED_TYPES`` for its DeepSpeed name).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from moebit.optim.lamb import Lamb
from moebit.optim.onebit_adam import OnebitAdam
from moebit.optim.onebit_lamb import OnebitLamb
from moebit.optim.outer import Blocks, OuterOptimizer
from moebit.optim.outer_compress import COMPRESSIONS as OUTER_COMPRESSIONS
from moebit.optim.zero_one_adam import ZeroOneAdam

logger = logging.getLogger("moebit.optim")

ParamGroups = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
Factory = Callable[..., Optimizer]


@dataclass(frozen=True)
class OptimizerSettings:
    """What every optimizer is built with; optimizer-specific keys travel as ``**extra``."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    freeze_step: int | str | None = None  # None: the optimizer's own default
    process_group: dist.ProcessGroup | None = None

    def adam_kwargs(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay}


def _adam(param_groups: ParamGroups, s: OptimizerSettings, decoupled: bool = True) -> Optimizer:
    """torch's AdamW when there is weight decay (decoupled, as OnebitAdam), else Adam.

    Extra group keys such as ``process_group`` are kept in the groups and ignored by
    torch: the training loop averages the gradients of each group before ``step``.
    """
    if s.freeze_step is not None:
        logger.warning("freeze_step=%r ignored: plain Adam has no compression stage", s.freeze_step)
    cls = torch.optim.AdamW if s.weight_decay and decoupled else torch.optim.Adam
    # foreach: one op per list, not per tensor; under FSDP2 every tensor op is a DTensor
    # dispatch (~0.1 ms), which made the per-tensor loop a quarter of a sharded step
    return cls(param_groups, **s.adam_kwargs(), foreach=True)


def _compressed(cls: type[Optimizer]) -> Factory:
    """The factory of a compressed optimizer whose ``freeze_step`` keeps its own meaning."""

    def factory(param_groups: ParamGroups, s: OptimizerSettings, **extra: Any) -> Optimizer:
        if s.freeze_step is not None:
            extra["freeze_step"] = s.freeze_step
        return cls(param_groups, process_group=s.process_group, **s.adam_kwargs(), **extra)

    factory.__name__ = f"_{cls.__name__}"
    return factory


def _zero_one_adam(param_groups: ParamGroups, s: OptimizerSettings, **extra: Any) -> Optimizer:
    """``freeze_step`` (the training loop's, 20% of the run by default) is 0/1 Adam's
    ``var_freeze_step``; giving both is an error."""
    if s.freeze_step is not None:
        if "var_freeze_step" in extra:
            raise ValueError("give freeze_step or var_freeze_step for zero_one_adam, not both")
        extra["var_freeze_step"] = s.freeze_step
    if extra.get("var_freeze_step") == "auto":
        raise ValueError(
            "zero_one_adam: freeze_step='auto' is not supported (only onebit_adam has the auto "
            "rule); give a step count (var_freeze_step)"
        )
    return ZeroOneAdam(param_groups, process_group=s.process_group, **s.adam_kwargs(), **extra)


def _lamb(param_groups: ParamGroups, s: OptimizerSettings, **extra: Any) -> Optimizer:
    """Exact LAMB; like torch Adam, the training loop averages its gradients."""
    if s.freeze_step is not None:
        logger.warning("freeze_step=%r ignored: exact LAMB has no compression stage", s.freeze_step)
    return Lamb(param_groups, **s.adam_kwargs(), **extra)


# Insertion order is the order names are listed in (the exact optimizers' compressed
# variants after them).
_REGISTRY: dict[str, Factory] = {
    "adam": _adam,
    "onebit_adam": _compressed(OnebitAdam),
    "zero_one_adam": _zero_one_adam,
    "onebit_lamb": _compressed(OnebitLamb),
    "lamb": _lamb,
}


# Optimizers that average exact gradients every step: no freeze step, no 1-bit stage.
EXACT_OPTIMIZERS = ("adam", "lamb")


def register_optimizer(name: str, factory: Factory) -> None:
    """Add ``name`` -> ``factory(param_groups, settings: OptimizerSettings, **extra)``;
    ``extra`` holds the keyword arguments of ``build_optimizer`` beyond the settings."""
    _REGISTRY[name] = factory


def optimizer_names() -> list[str]:
    """Registered names, in registration order."""
    return list(_REGISTRY)


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
    settings = OptimizerSettings(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                 freeze_step=freeze_step, process_group=process_group)
    return factory(param_groups, settings, **extra)


# Flat settings keys of low-communication training -> OuterOptimizer keyword; every
# compression in OUTER_COMPRESSIONS. Defaults are the DiLoCo paper's (lr 0.7, Nesterov 0.9).
OUTER_KEYS = {"outer_every": "every", "outer_lr": "lr", "outer_momentum": "momentum",
              "outer_nesterov": "nesterov", "outer_compress": "compress",
              "outer_fragments": "fragments", "outer_delay": "delay", "outer_alpha": "alpha",
              "outer_int8_block": "int8_block", "outer_onebit_block": "onebit_block",
              "outer_fragment_cut": "cut"}


def build_outer_optimizer(inner: Optimizer, blocks: Blocks, group: dist.ProcessGroup | None,
                          share: dist.ProcessGroup | None = None,
                          **settings: Any) -> OuterOptimizer:
    """DiLoCo around ``inner`` from flat keys (``outer_every=50, outer_compress="int8"``...),
    the names a config file uses; an unknown key is an error naming it. ``share``: see
    ``OuterOptimizer``."""
    unknown = sorted(set(settings) - set(OUTER_KEYS))
    if unknown:
        raise ValueError(f"unknown outer optimizer key(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(OUTER_KEYS)} (compressions: {', '.join(OUTER_COMPRESSIONS)})")
    if "outer_every" not in settings:
        raise ValueError("outer_every (inner steps between outer syncs) is required")
    return OuterOptimizer(inner, blocks, group, share=share,
                          **{OUTER_KEYS[k]: v for k, v in settings.items()})


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
    "zerooneadam": (
        "zero_one_adam",
        {
            **_COMMON,
            "var_freeze_step": 100000,
            "var_update_scaler": 16,
            "local_step_scaler": 32678,
            "local_step_clipper": 16,
            "bias_correction": True,
            "eps_inside_sqrt": False,
            "max_grad_norm": 0.0,
            "amsgrad": False,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    ),
    "onebitlamb": (
        "onebit_lamb",
        {
            **_COMMON,
            "freeze_step": 100000,
            "max_coeff": 10.0,
            "min_coeff": 0.01,
            "coeff_beta": 0.9,
            "factor_max": 4.0,
            "factor_min": 0.5,
            "factor_threshold": 0.1,
            "bias_correction": True,
            "eps_inside_sqrt": False,
            "max_grad_norm": 0.0,
            "amsgrad": False,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    ),
    "lamb": (
        "lamb",
        {**_COMMON, "max_coeff": 10.0, "min_coeff": 0.01, "bias_correction": True,
         "max_grad_norm": 0.0, "amsgrad": False},
    ),
}
# Accepted for compatibility; they select DeepSpeed transports or kernels moebit does not need.
_NOT_NEEDED = {"cuda_aware", "comm_backend_name", "torch_adam"}
# Per type, the params passed through to the optimizer under their DeepSpeed names.
_PASSED = {
    "zero_one_adam": ("var_freeze_step", "var_update_scaler", "local_step_scaler",
                      "local_step_clipper"),
    "onebit_lamb": ("freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max",
                    "factor_min", "factor_threshold"),
    "lamb": ("max_coeff", "min_coeff"),
}


def optimizer_from_deepspeed_config(
    cfg: dict[str, Any],
    param_groups: ParamGroups,
    *,
    process_group: dist.ProcessGroup | None = None,
    **extra: Any,
) -> Optimizer:
    """Build from ``{"optimizer": {"type": "OneBitAdam", "params": {...}}}``.

    Types: Adam, AdamW, OneBitAdam, ZeroOneAdam, OneBitLamb, Lamb, with DeepSpeed's
    parameter names and defaults (``freeze_step``/``var_freeze_step`` default to 100000 as
    in DeepSpeed: set them; OneBitAdam also takes "auto"). Keys of the config other than
    "optimizer" are ignored here (they belong to other parts). Unknown params raise ValueError naming them.
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
    if name in _PASSED:
        if p["max_grad_norm"]:
            raise ValueError(
                "max_grad_norm is not applied by the optimizer: clip gradients in the training "
                "loop instead"
            )
        passed = {k: p[k] for k in _PASSED[name]}
        if name != "lamb" and "freeze_step" not in given and "var_freeze_step" not in given:
            logger.info("DeepSpeed %s without a freeze step: using DeepSpeed's default 100000",
                        ds_type)
        if p.get("eps_inside_sqrt"):
            raise ValueError("eps_inside_sqrt=True is not supported: eps is added outside sqrt(v)")
        freeze = passed.pop("freeze_step", None)
        return build_optimizer(name, param_groups, freeze_step=freeze,
                               bias_correction=bool(p["bias_correction"]), **passed, **kwargs,
                               **extra)
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
