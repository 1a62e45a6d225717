"""The training configuration: a model config, its MoE settings, and the run's own settings.

``TrainConfig`` composes: ``cfg.model`` is the ``GPTConfig`` (whose ``moe`` is the
``MoEConfig`` every MoE block starts from) and the rest are training settings. On the
command line and in files the keys are flat and unique, so every field of all three is
a ``moebit train`` flag (``n_layer`` is ``--n-layer``, ``drop_policy`` is
``--drop-policy``) and a key of a TOML or JSON ``--config`` file, where tables such as
``[model]`` or ``[moe]`` only group keys. ``to_dict()`` writes the same flat keys, so a
run's ``config.json`` reads back through the same path. Unknown keys and bad values are
errors that name the key.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import sys
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from moebit.comm.outer_groups import OUTER_GROUP_MODES
from moebit.models.gpt import GPTConfig
from moebit.models.hf.config import read_config
from moebit.models.registry import family_of, family_of_folder
from moebit.moe import MoEConfig
from moebit.optim import EXACT_OPTIMIZERS, OuterSettings, optimizer_names
from moebit.training.shard_config import (
    DTYPES,
    MODES,
    SHARD_MODES,
    TRANSPORTS,
    UNITS,
    check_composition,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A setting is unknown or out of range; the message names it."""


@dataclass
class TrainConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    # data
    data: str | None = None
    batch_size: int = 16
    encoding: str = "utf-8"  # of the corpus files; they are re-encoded to UTF-8 bytes
    encoding_errors: str = "strict"  # "replace": undecodable bytes become U+FFFD, not a skip
    allow_skipped: bool = False  # train even when more than half the corpus bytes are skipped
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
    # low-communication training (docs/low-communication.md): an outer optimizer around the
    # inner one; "none" trains plain data-parallel
    outer: str = "none"  # none | diloco | streaming_diloco
    outer_every: int = 0  # H: inner steps between two syncs of a fragment (required with outer)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    outer_compress: str = "none"  # none | bf16 | int8 | 1bit
    outer_fragments: int = 0  # F; 0: 1 for diloco, as many as fit for streaming_diloco
    outer_delay: int = 0  # D: inner steps a fragment's exchange overlaps (streaming_diloco)
    outer_alpha: float = 0.0  # mixing of a late update into the local parameters
    outer_int8_block: int = 256
    outer_onebit_block: int = 256  # elements per 1-bit scale (0: one scale per chunk)
    outer_fragment_cut: str = "blocks"  # blocks: whole layers per fragment; even: equal runs
    outer_group: str = "node"  # node: a worker per node; world: every rank its own worker
    # sharded training (docs/sharding.md): FSDP2 splits parameters, gradients and optimizer
    # state over the ranks; "none" keeps a whole replica on every rank
    shard: str = "none"  # none | fsdp | hsdp (shard inside a node, replicate across nodes)
    reshard_after_forward: bool = True  # free gathered weights after forward (regather in backward)
    shard_unit: str = "block"  # block: one FSDP2 unit per decoder block; model: one for all
    shard_transport: str = "auto"  # auto (measured) | native | a2a: exact gathers/scatters
    param_dtype: str | None = None  # fp32 | bf16 | fp16: compute / all-gather dtype (None: own)
    reduce_dtype: str | None = None  # fp32 | bf16 | fp16: gradient reduction dtype
    rs_compress: str = "none"  # none | bf16 | int8: the gradient reduce-scatter's wire format
    ag_compress: str = "none"  # none | bf16 | int8: the weight all-gather's wire format
    # run
    seed: int = 1337
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    dtype: str = "auto"  # auto: bf16 autocast where it measures faster (moebit.runs.dtype_probe)
    device: str = "auto"
    threads: int = 0  # 0: the machine's cores divided by the ranks on this node
    run_dir: str | None = None
    samples: int = 2  # lines of generated text printed at the end
    tensorboard: bool = False  # also write metrics as TensorBoard events in RUN/tensorboard
    wandb: bool = False  # also log to Weights & Biases, offline, in RUN/wandb
    # checkpoints and faults
    save_every: int = 0  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    on_nan: str = "skip"  # a non-finite loss or gradient: skip the step, or stop the run
    max_nan_skips: int = 10  # consecutive skipped steps before the run stops anyway
    resume: bool = False  # set by `moebit train --resume RUN`: continue from its latest checkpoint
    extra: dict[str, Any] = field(default_factory=dict)  # optimizer-specific settings
    # a model folder (a Hugging Face folder) to fine-tune; None trains moebit's GPT from scratch
    init_from: str | None = None
    # not a key: init_from's model config as its family reads it (its sequence length
    # block_size, its experts sharded ep_size ways), attached by build(); the folder is the
    # source of truth
    pretrained: Any = field(default=None, compare=False, repr=False)

    @property
    def moe(self) -> MoEConfig | None:
        """The MoE blocks' settings (None for a dense model)."""
        mcfg = self.model_config()
        return family_of(mcfg).moe(mcfg)

    def model_config(self) -> Any:
        """The model's config: the GPTConfig, or with ``init_from`` the folder's (``pretrained``)."""
        if not self.init_from:
            return self.model
        if self.pretrained is None:
            raise ConfigError("init_from: the model folder's config was not read; make the "
                              "TrainConfig with moebit.training.config.build (or attach_pretrained)")
        return self.pretrained

    def resolved_freeze_step(self) -> int | str | None:
        if self.optimizer in EXACT_OPTIMIZERS:
            return None
        if self.freeze_step is None:
            return max(1, round(0.2 * self.steps))
        return self.freeze_step

    def to_dict(self) -> dict[str, Any]:
        """Flat keys, as flags and config files spell them."""
        out: dict[str, Any] = {}
        moe = self.moe or MoEConfig(num_experts=1)
        for key, (owner, name) in FLAT_KEYS.items():
            src = self if owner == "train" else self.model if owner == "model" else moe
            value = getattr(src, name)
            out[key] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return out


# Flat key -> (owner, field name). The model's ``moe`` and ``vocab_size`` are not keys (the
# first is these MoE keys, the second is fixed by the byte-level data); of MoEConfig,
# ``num_experts`` is the model's (a count or one per MoE block), ``d_ffn`` is spelled
# ``expert_d_ffn`` (unset: the model's ``d_ffn``) and ``residual`` ``moe_residual``.
_MODEL_SKIP = ("moe", "vocab_size")
_MOE_SKIP = ("num_experts",)
_MOE_RENAMES = {"residual": "moe_residual", "d_ffn": "expert_d_ffn"}


def _flat_keys() -> dict[str, tuple[str, str]]:
    keys: dict[str, tuple[str, str]] = {}
    for f in dataclasses.fields(GPTConfig):
        if f.name not in _MODEL_SKIP:
            keys[f.name] = ("model", f.name)
    for f in dataclasses.fields(MoEConfig):
        if f.name not in _MOE_SKIP:
            keys[_MOE_RENAMES.get(f.name, f.name)] = ("moe", f.name)
    for f in dataclasses.fields(TrainConfig):
        if f.name not in ("model", "pretrained"):
            keys[f.name] = ("train", f.name)
    return keys


FLAT_KEYS = _flat_keys()
_OWNERS = {"model": GPTConfig, "moe": MoEConfig, "train": TrainConfig}


def flat_fields(owner: str) -> list[tuple[str, dataclasses.Field]]:
    """(flat key, dataclass field) of one owner ("model", "moe" or "train"), for the CLI."""
    by_name = {f.name: f for f in dataclasses.fields(_OWNERS[owner])}
    return [(k, by_name[n]) for k, (o, n) in FLAT_KEYS.items() if o == owner]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _check_value(key: str, value: Any) -> Any:
    """Coerce ``value`` to the key's type or raise a ConfigError naming ``key``."""
    owner, name = FLAT_KEYS[key]
    f = next(f for f in dataclasses.fields(_OWNERS[owner]) if f.name == name)
    proto, ann = _default(f), str(f.type)
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
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"freeze_step: expected a step number or 'auto', got {value!r}") from None
    if "None" in ann and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    if value is None:
        raise ConfigError(f"{key}: a value is required, got {value!r}")
    if isinstance(proto, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table/object, got {value!r}")
        return value
    if isinstance(proto, bool) or ann.startswith("bool"):
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(proto, int) or ann.startswith("int"):
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if isinstance(proto, float) or ann.startswith("float"):
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(v):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return v
    if isinstance(proto, str) or ann.startswith("str"):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range checks of the training settings (the model and MoE configs check their own)."""
    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{key}: {msg} (got {getattr(cfg, key)!r})")

    for key in ("batch_size", "steps", "eval_every", "eval_batches", "log_every"):
        need(getattr(cfg, key) > 0, key, "must be positive")
    for key in ("warmup_steps", "threads", "samples", "save_every", "max_nan_skips"):
        need(getattr(cfg, key) >= 0, key, "must be >= 0")
    need(cfg.lr > 0, "lr", "must be positive")
    need(0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
    need(0 <= cfg.beta1 < 1, "beta1", "must be in [0, 1)")
    need(0 <= cfg.beta2 < 1, "beta2", "must be in [0, 1)")
    need(cfg.eps >= 0, "eps", "must be >= 0")
    need(cfg.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(cfg.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
    need(cfg.dtype in ("auto", "bf16", "fp32"), "dtype", "must be auto, bf16 or fp32")
    need(cfg.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
    need(cfg.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
    need(cfg.on_nan in ("skip", "stop"), "on_nan", "must be skip or stop")
    need(cfg.encoding_errors in ("strict", "replace"), "encoding_errors", "must be strict or replace")
    try:
        codecs.lookup(cfg.encoding)
    except LookupError:
        need(False, "encoding", "is not a known text encoding")
    names = optimizer_names()
    need(cfg.optimizer in names, "optimizer", f"must be one of {', '.join(names)}")
    if isinstance(cfg.freeze_step, int):
        need(cfg.freeze_step >= 1, "freeze_step", "must be >= 1 (at least one exact step) or 'auto'")
    # checked here, before any rank starts: only 1-bit Adam watches its variance for the freeze
    need(cfg.freeze_step != "auto" or cfg.optimizer in ("onebit_adam",) + EXACT_OPTIMIZERS,
         "freeze_step", f"'auto' is not supported by {cfg.optimizer} (only onebit_adam has the "
         "auto rule); give a step count")
    validate_outer(cfg)
    validate_shard(cfg)
    return cfg


def validate_shard(cfg: TrainConfig) -> None:
    """The sharding keys on their own and against the optimizer and the outer optimizer
    (the mesh against the world size is the launcher's check, ``moebit.cli.validate``)."""
    if cfg.shard not in SHARD_MODES:
        raise ConfigError(f"shard: must be one of {', '.join(SHARD_MODES)} (got {cfg.shard!r})")
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(cfg, key) not in (None, *DTYPES):
            raise ConfigError(f"{key}: must be one of {', '.join(DTYPES)} or none (got "
                              f"{getattr(cfg, key)!r})")
    for key, known in (("shard_unit", UNITS), ("shard_transport", TRANSPORTS)):
        if getattr(cfg, key) not in known:
            raise ConfigError(f"{key}: must be one of {', '.join(known)} (got "
                              f"{getattr(cfg, key)!r})")
    for key in ("rs_compress", "ag_compress"):
        value = getattr(cfg, key)
        if value not in MODES:
            raise ConfigError(f"{key}: must be one of {', '.join(MODES)} (got {value!r})")
        if value != "none" and cfg.shard == "none":
            raise ConfigError(f"{key}: {key}={value} compresses a sharded collective; it needs "
                              f"shard=fsdp or hsdp (shard is none)")
    if cfg.shard == "none":
        return
    try:
        check_composition(cfg.optimizer, cfg.shard)
    except ValueError as e:
        raise ConfigError(f"optimizer: {e}") from None
    if cfg.outer != "none" and cfg.shard == "hsdp":
        raise ConfigError(f"shard: outer={cfg.outer} does not compose with shard=hsdp (hsdp "
                          f"averages gradients across nodes every step, the traffic the outer "
                          f"optimizer replaces); use shard=fsdp with outer_group=node")
    if cfg.outer != "none" and cfg.outer_group != "node":
        raise ConfigError(f"outer_group: outer_group={cfg.outer_group} with shard={cfg.shard} "
                          f"makes every rank its own DiLoCo worker, leaving one rank to shard "
                          f"over; use outer_group=node (fsdp inside each node)")


OUTER_MODES = ("none", "diloco", "streaming_diloco")


def validate_outer(cfg: TrainConfig) -> None:
    """The outer optimizer's settings that do not depend on the model or the launch (the
    number of blocks and the topology are checked by the launcher, ``moebit.cli.validate``).

    Off (``outer`` none), the other ``outer_*`` keys are ignored, so one config file serves
    both kinds of run."""
    if cfg.outer not in OUTER_MODES:
        raise ConfigError(f"outer: must be one of {', '.join(OUTER_MODES)} (got {cfg.outer!r})")
    if cfg.outer == "none":
        return
    if cfg.outer_every < 1:
        raise ConfigError(f"outer_every: outer={cfg.outer} needs outer_every >= 1, the inner "
                          f"steps between two syncs (got {cfg.outer_every!r})")
    if cfg.outer_group not in OUTER_GROUP_MODES:
        raise ConfigError(f"outer_group: must be one of {', '.join(OUTER_GROUP_MODES)} "
                          f"(got {cfg.outer_group!r})")
    if cfg.outer_fragments < 0:
        raise ConfigError(f"outer_fragments: must be >= 1, or 0 for the default (got "
                          f"{cfg.outer_fragments!r})")
    if cfg.outer == "diloco" and (cfg.outer_fragments > 1 or cfg.outer_delay > 0):
        key = "outer_fragments" if cfg.outer_fragments > 1 else "outer_delay"
        raise ConfigError(f"{key}: outer=diloco syncs the whole model at once, without overlap "
                          f"(got {key}={getattr(cfg, key)!r}); use outer=streaming_diloco")
    try:  # the library's own checks, with a placeholder of 1 fragment where F is automatic
        OuterSettings(cfg.outer_every, cfg.outer_lr, cfg.outer_momentum, cfg.outer_nesterov,
                      cfg.outer_compress, max(1, cfg.outer_fragments), cfg.outer_delay,
                      cfg.outer_alpha, cfg.outer_int8_block, cfg.outer_onebit_block,
                      cfg.outer_fragment_cut)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_file(path: str) -> dict[str, Any]:
    """Read a TOML or JSON config file into a dict of flat keys."""
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
    for k, v in raw.items():
        if isinstance(v, dict) and k not in FLAT_KEYS:
            flat.update(v)
        else:
            flat[k] = v
    return {k.replace("-", "_"): v for k, v in flat.items()}


def build(file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
          source: str = "config") -> TrainConfig:
    """Defaults, then ``file_values``, then ``overrides`` (flags); validated."""
    values: dict[str, dict[str, Any]] = {"model": {}, "moe": {}, "train": {}}
    for where, layer in ((source, file_values or {}), ("flags", overrides or {})):
        for k, v in layer.items():
            if k not in FLAT_KEYS:
                close = [n for n in FLAT_KEYS if n.startswith(k[:3])]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown setting {k!r} in {where}{hint}")
            owner, name = FLAT_KEYS[k]
            values[owner][name] = _check_value(k, v)
    try:
        model = GPTConfig(**values["model"], moe=values["moe"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg = validate(TrainConfig(model=model, **values["train"]))
    if cfg.init_from:  # ep_size is the folder model's (a dense GPT config would drop it)
        attach_pretrained(cfg, ep_size=values["moe"].get("ep_size", 1))
    return cfg


def attach_pretrained(cfg: TrainConfig, ep_size: int = 1) -> TrainConfig:
    """Read ``cfg.init_from``'s model config into ``cfg.pretrained`` through its family:
    sequence length ``block_size``, experts sharded ``ep_size`` ways. A bad folder or an
    over-long block is a ConfigError."""
    folder = Path(str(cfg.init_from))
    fam = family_of_folder(folder)
    try:
        if fam is None:
            # the Hugging Face reader names what is missing (config.json, model_type, weights)
            mcfg = read_config(folder, ep_size=ep_size)
            raise ValueError(f"{folder} is not a model folder (config.json with a model_type, "
                             "and safetensors weights)")
        mcfg = fam.read_folder_config(folder, ep_size=ep_size)
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from: {e}") from None
    limit = getattr(mcfg, "max_position_embeddings", None)
    if limit is not None and cfg.model.block_size > limit:
        raise ConfigError(f"block_size {cfg.model.block_size} exceeds the model's "
                          f"max_position_embeddings {limit}")
    cfg.pretrained = dataclasses.replace(mcfg, block_size=cfg.model.block_size)
    return cfg
