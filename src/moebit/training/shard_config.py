"""The settings of sharded training, and which layouts and optimizers compose with them.

Kept apart from ``moebit.training.sharding`` (which shards a model with FSDP2) because
the config, the launcher's checks and every rank's start read these, while importing
FSDP2 and DTensor costs a second or more per process: only a sharded run pays for it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any

SHARD_MODES = ("none", "fsdp", "hsdp")
# The dtype names the keys take; ``torch_dtype`` maps them.
DTYPES = ("fp32", "bf16", "fp16")
MODES = ("none", "bf16", "int8")  # what rs_compress / ag_compress take
UNITS = ("block", "model")  # what unit takes
TRANSPORTS = ("auto", "native", "a2a")  # how exact sharded collectives travel
DEFAULT_BLOCK = 256  # elements sharing one int8 scale


@dataclass
class ShardConfig:
    """How to shard: the loop maps its flat keys onto these fields.

    ``param_dtype`` / ``reduce_dtype``: "fp32", "bf16", "fp16" or None (keep the
    parameters' own dtype; reduce in the compute dtype). ``local_world_size`` is the
    node size for hsdp (0: torchrun's LOCAL_WORLD_SIZE). ``quant_block`` is the number of
    elements sharing one int8 scale. ``unit``: "block" makes every decoder block (and
    every expert module) its own FSDP2 unit, so a rank holds one gathered block at a time;
    "model" makes one unit per mesh (all experts; the rest), so a step runs one all-gather
    and one reduce-scatter each, as few collectives as a replicated run's allreduce, and
    holds the whole gathered model while it computes. ``transport``: how the exact
    all-gathers and reduce-scatters travel (``moebit.training.shard_transport``: "auto"
    measures the backend's collective against an all-to-all). ``node_local``: shard
    inside each node only and leave the nodes independent replicas (fsdp under an outer
    optimizer, which syncs them: the dense mesh is the node, not the world).
    """

    shard: str = "none"
    reshard_after_forward: bool = True
    unit: str = "block"
    transport: str = "auto"
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    rs_compress: str = "none"
    ag_compress: str = "none"
    local_world_size: int = 0
    quant_block: int = DEFAULT_BLOCK
    node_local: bool = False

    def __post_init__(self) -> None:
        if self.shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES}, got {self.shard!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}")
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPES:
                raise ValueError(f"{key} must be one of {tuple(DTYPES)} or None, got {value!r}")
        for key in ("rs_compress", "ag_compress"):
            if getattr(self, key) not in MODES:
                raise ValueError(f"{key} must be one of {MODES}, got {getattr(self, key)!r}")
        if self.shard == "none" and (self.rs_compress, self.ag_compress) != ("none", "none"):
            raise ValueError("rs_compress/ag_compress need shard=fsdp or hsdp (shard is none)")
        if self.local_world_size < 0:
            raise ValueError(f"local_world_size must be >= 0, got {self.local_world_size}")
        if self.quant_block < 1:
            raise ValueError(f"quant_block must be >= 1, got {self.quant_block}")
        if self.node_local and self.shard != "fsdp":
            raise ValueError(f"node_local shards inside each node with shard=fsdp, got "
                             f"shard={self.shard!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardConfig:
        """From flat keys (a config file's or the loop's), naming an unknown key."""
        known = [f.name for f in fields(cls)]
        for key in d:
            if key not in known:
                raise ValueError(f"unknown sharding key {key!r}; known: {', '.join(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for these dtypes."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch_dtype(self.param_dtype),
                                    reduce_dtype=torch_dtype(self.reduce_dtype))


def torch_dtype(name: str | None) -> Any:
    """The torch dtype of a dtype key's value (None stays None)."""
    if name is None:
        return None
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(frozen=True)
class Layout:
    """The sizes of a sharded layout: ``nodes`` x ``node`` ranks; experts sharded over
    ``efsdp`` = node / ep ranks inside each node (fsdp: one node of the whole world, unless
    ``node_local``: then each node is its own fsdp mesh)."""

    world: int
    nodes: int
    node: int
    ep_size: int

    @property
    def efsdp(self) -> int:
        return self.node // self.ep_size


def check_layout(cfg: ShardConfig, world: int, ep_size: int = 1,
                 local_experts: int | None = None) -> Layout:
    """The layout of ``cfg`` on ``world`` ranks, or a one-line ValueError naming why it is
    impossible; pure (no process group), so a launcher can call it before any rank starts.

    ``local_experts`` (num_experts / ep_size), when given, must split evenly over efsdp.
    """
    if cfg.shard == "none":
        raise ValueError("shard is none: there is nothing to lay out")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the world size {world}")
    node = world
    if cfg.node_local:
        node = cfg.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if node < 1 or world % node:
            raise ValueError(f"fsdp inside each node: the node size LOCAL_WORLD_SIZE={node} "
                             f"does not divide the world size {world}")
        if node % ep_size:
            raise ValueError(f"fsdp inside each node: ep_size={ep_size} must divide the node "
                             f"size {node} (experts are sharded inside a node)")
    if cfg.shard == "hsdp":
        node = cfg.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if node < 1 or world % node:
            raise ValueError(f"hsdp: the node size LOCAL_WORLD_SIZE={node} does not divide "
                             f"the world size {world}")
        if node == world:
            raise ValueError(f"hsdp needs more than one node: LOCAL_WORLD_SIZE={node} is the "
                             f"whole world; use shard=fsdp")
        if node % ep_size:
            raise ValueError(f"hsdp: ep_size={ep_size} must divide the node size {node} "
                             f"(experts are sharded inside a node)")
    layout = Layout(world, world // node, node, ep_size)
    if local_experts is not None and ep_size > 1 and local_experts % layout.efsdp:
        raise ValueError(f"{local_experts} local experts (num_experts / ep_size) do not split "
                         f"over the {layout.efsdp} expert-data-parallel ranks; choose ep_size "
                         f"so that (num_experts / ep_size) % ({node} / ep_size) == 0")
    return layout


# Which optimizer composes with which sharding; the reasons are the refusal messages.
_REFUSED = {
    "onebit_adam": "its 1-bit allreduce compresses whole replicated momenta with per-tensor "
                   "error feedback, while sharding keeps only a shard of each gradient per rank",
    "zero_one_adam": "its 1-bit variance/momentum exchange and local steps need whole "
                     "replicated tensors, while sharding keeps only a shard per rank",
    "onebit_lamb": "its 1-bit allreduce and per-layer trust ratios need whole replicated "
                   "momenta, while sharding keeps only a shard per rank",
}
COMPOSES = ("adam", "lamb")


def check_composition(optimizer_name: str, shard: str) -> None:
    """Raise a one-line ValueError when ``optimizer_name`` cannot run under ``shard``.

    The 1-bit optimizers exchange compressed momenta of whole parameters and keep
    error feedback for each; FSDP hands each rank a shard of the already-averaged
    gradient, so their exchange would have nothing to compress. Sharded runs compress the
    gradient reduce-scatter instead (``rs_compress``). See docs/sharding.md.
    """
    if shard not in SHARD_MODES:
        raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
    if shard == "none":
        return
    if optimizer_name in _REFUSED:
        raise ValueError(f"optimizer {optimizer_name!r} does not compose with shard={shard}: "
                         f"{_REFUSED[optimizer_name]}; use adam or lamb with rs_compress=int8")
    if optimizer_name not in COMPOSES:
        raise ValueError(f"optimizer {optimizer_name!r} is not known to compose with "
                         f"shard={shard}; composing: {', '.join(COMPOSES)}")
