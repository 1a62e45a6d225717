"""The training configuration: one flat dataclass, filled from defaults, a file, then flags.

Every field is also a ``moebit train`` flag (``n_layer`` is ``--n-layer``) and a key of a
TOML or JSON ``--config`` file. Unknown keys and bad values are errors that name the key.
"""

from __future__ import annotations

import json
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from moebit.comm.all_to_all import A2A_DTYPES
from moebit.models.gpt import GPTConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

OPTIMIZERS = ("adam", "onebit_adam", "zero_one_adam", "onebit_lamb", "lamb")


class ConfigError(ValueError):
    """A setting is unknown or out of range; the message names it."""


@dataclass
class TrainConfig:
    # model
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ffn: int = 0
    block_size: int = 256
    dropout: float = 0.0
    # mixture of experts (0 experts = dense)
    num_experts: int | list[int] = 0
    moe_every: int = 2
    num_experts_per_tok: int = 1
    moe_residual: bool = False
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    drop_tokens: bool = True
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    ep_size: int = 1
    a2a_dtype: str = "auto"  # expert-parallel token all-to-all wire format (MoEConfig)
    a2a_grad_dtype: str = "auto"
    a2a_hierarchical: bool = False
    a2a_chunks: int = 1
    # data
    data: str | None = None
    batch_size: int = 16
    # optimisation
    optimizer: str = "adam"
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    freeze_step: str | int | None = None  # 1-bit optimizers: a step, "auto", or ~20% of steps
    steps: int = 300
    # run
    seed: int = 1337
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    dtype: str = "bf16"
    device: str = "auto"
    threads: int = 0  # 0: the machine's cores divided by the ranks on this node
    run_dir: str | None = None
    samples: int = 2  # lines of generated text printed at the end
    # checkpoints and faults
    save_every: int = 0  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    on_nan: str = "skip"  # a non-finite loss or gradient: skip the step, or stop the run
    max_nan_skips: int = 10  # consecutive skipped steps before the run stops anyway
    resume: bool = False  # set by `moebit train --resume RUN`: continue from its latest checkpoint
    extra: dict[str, Any] = field(default_factory=dict)  # optimizer-specific settings

    def model_config(self) -> GPTConfig:
        moe = {
            "num_experts_per_tok": self.num_experts_per_tok,
            "residual": self.moe_residual,
            "capacity_factor": self.capacity_factor,
            "eval_capacity_factor": self.eval_capacity_factor,
            "drop_tokens": self.drop_tokens,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "router_z_loss_coef": self.router_z_loss_coef,
            "ep_size": self.ep_size,
            "a2a_dtype": self.a2a_dtype,
            "a2a_grad_dtype": self.a2a_grad_dtype,
            "a2a_hierarchical": self.a2a_hierarchical,
            "a2a_chunks": self.a2a_chunks,
        }
        return GPTConfig(
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.d_model,
            d_ffn=self.d_ffn,
            dropout=self.dropout,
            num_experts=self.num_experts,
            moe_every=self.moe_every,
            moe=moe if self.num_experts else {},
        )

    def resolved_freeze_step(self) -> int | str | None:
        if self.optimizer in ("adam", "lamb"):
            return None
        if self.freeze_step is None:
            return max(1, round(0.2 * self.steps))
        return self.freeze_step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _field_types() -> dict[str, Any]:
    return {f.name: f.type for f in fields(TrainConfig)}


def _check_value(key: str, value: Any) -> Any:
    """Coerce ``value`` to the field's type or raise a ConfigError naming ``key``."""
    default = {f.name: f for f in fields(TrainConfig)}[key]
    proto = default.default if default.default is not MISSING else default.default_factory()  # type: ignore[misc]
    if key == "num_experts":
        if isinstance(value, str):
            value = [int(v) for v in value.split(",")] if "," in value else int(value)
        if isinstance(value, list):
            return [int(v) for v in value]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an int or a list of ints, got {value!r}")
        return value
    if key == "freeze_step":
        if value is None or value == "auto":
            return value
        try:
            v = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"freeze_step: expected a step number or 'auto', got {value!r}") from None
        return v
    if key in ("data", "run_dir"):
        return None if value is None else str(value)
    if key == "extra":
        if not isinstance(value, dict):
            raise ConfigError(f"extra: expected a table/object, got {value!r}")
        return value
    if isinstance(proto, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(proto, int):
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if isinstance(proto, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if isinstance(proto, str):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range checks that need more than one field; returns ``cfg`` for chaining."""
    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{key}: {msg} (got {getattr(cfg, key)!r})")

    for key in ("n_layer", "n_head", "d_model", "block_size", "batch_size", "steps",
                "eval_every", "eval_batches", "log_every", "moe_every", "ep_size",
                "num_experts_per_tok"):
        need(getattr(cfg, key) > 0, key, "must be positive")
    for key in ("d_ffn", "warmup_steps", "threads", "samples", "save_every", "max_nan_skips"):
        need(getattr(cfg, key) >= 0, key, "must be >= 0")
    need(cfg.lr > 0, "lr", "must be positive")
    need(0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
    need(0 <= cfg.beta1 < 1, "beta1", "must be in [0, 1)")
    need(0 <= cfg.beta2 < 1, "beta2", "must be in [0, 1)")
    need(cfg.eps >= 0, "eps", "must be >= 0")
    need(cfg.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(cfg.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
    need(cfg.capacity_factor > 0, "capacity_factor", "must be positive")
    need(cfg.eval_capacity_factor > 0, "eval_capacity_factor", "must be positive")
    need(cfg.dtype in ("bf16", "fp32"), "dtype", "must be bf16 or fp32")
    need(cfg.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
    need(cfg.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
    need(cfg.on_nan in ("skip", "stop"), "on_nan", "must be skip or stop")
    need(cfg.optimizer in OPTIMIZERS, "optimizer", f"must be one of {', '.join(OPTIMIZERS)}")
    for key in ("a2a_dtype", "a2a_grad_dtype"):
        need(getattr(cfg, key) in A2A_DTYPES, key, f"must be one of {', '.join(A2A_DTYPES)}")
    if isinstance(cfg.freeze_step, int):
        need(cfg.freeze_step >= 1, "freeze_step", "must be >= 1 (at least one exact step) or 'auto'")
    try:
        cfg.model_config()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def load_file(path: str) -> dict[str, Any]:
    """Read a TOML or JSON config file into a dict of TrainConfig keys."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path!r}: no such file")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            raw = tomllib.loads(text)
        elif p.suffix == ".json":
            raw = json.loads(text)
        else:
            raise ConfigError(f"--config {path!r}: expected a .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--config {path!r}: cannot parse: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path!r}: expected a table/object at the top level")
    # Tables are a convenience for grouping ([model], [moe], ...): flatten one level.
    flat: dict[str, Any] = {}
    known = _field_types()
    for k, v in raw.items():
        if isinstance(v, dict) and k not in known:
            flat.update(v)
        else:
            flat[k] = v
    return {k.replace("-", "_"): v for k, v in flat.items()}


def build(file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
          source: str = "config") -> TrainConfig:
    """Defaults, then ``file_values``, then ``overrides`` (flags); validated."""
    known = _field_types()
    values: dict[str, Any] = {}
    for where, layer in ((source, file_values or {}), ("flags", overrides or {})):
        for k, v in layer.items():
            if k not in known:
                close = [n for n in known if n.startswith(k[:3])]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown setting {k!r} in {where}{hint}")
            values[k] = _check_value(k, v)
    return validate(TrainConfig(**values))
