"""A sharded run's model without the full model on any rank (issue 27).

``--shard fsdp|hsdp`` used to build the whole model on every rank, broadcast rank 0's
weights and only then shard, so a model that did not fit one rank replicated could not
train sharded either. Now the family builds it on the meta device while the build is
recorded (``meta_init.record_build``), FSDP2 shards it there, ``to_empty`` gives each
rank the storage of its own shards, and the recorded build is replayed on CPU from the
same seed, each parameter's local rows copied out of its full value as soon as it is
final (``meta_init.replay``): the shards are bit-identical to the rows of the replicated
run's initial weights (experts over ep x efsdp included), with no broadcast, and the
build holds the shards plus about one full tensor at a time.

``--init-from HF_DIR`` builds the same way without the replay (``build_sharded_empty``)
and each rank reads its rows of the safetensors (``shard_init``). A run whose hooks
change the built model (``init_model``: a distilled student copied from its teacher)
builds whole, as before, since the hook needs the whole model.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from moebit.models.hf.config import HFDecoderConfig
from moebit.models.registry import family_of
from moebit.training.config import TrainConfig
from moebit.training.meta_init import ReplayReport, record_build, replay, targets
from moebit.training.shard_config import ShardConfig
from moebit.training.shard_loop import shard_config


def _quiet_fsdp() -> None:
    # FSDP2 warns when a unit returns a view; moebit's blocks and heads return fresh
    # tensors nobody modifies in place (the sharded gradients equal the replicated ones)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


def shard(cfg: TrainConfig, model: Any) -> None:
    """FSDP2 over the ranks, in place, as ``cfg`` asks; collective."""
    from moebit.training.sharding import shard_model  # FSDP2: only sharded runs import it

    _quiet_fsdp()
    shard_model(model, shard_config(cfg))


def build_sharded_empty(mcfg: Any, scfg: ShardConfig, device: torch.device | str = "cpu") -> Any:
    """This rank's model of ``mcfg`` sharded as ``scfg`` says, with storage for its shards
    only and no values (its buffers computed on materialisation, as the rotary
    frequencies are): for weights read from a folder afterwards (``shard_init``)."""
    from moebit.training.sharding import shard_model  # FSDP2: only sharded runs import it

    model = family_of(mcfg).build(mcfg, device="meta")
    _quiet_fsdp()
    shard_model(model, scfg, device_type=torch.device(device).type)
    return model.to_empty(device=device)


def build_sharded(mcfg: Any, scfg: ShardConfig,
                  device: torch.device | str = "cpu") -> tuple[Any, ReplayReport]:
    """This rank's model of the model config ``mcfg`` (any family) sharded as ``scfg``
    says, freshly initialised exactly as ``family.build(mcfg)`` would be from the same RNG
    state (which every rank must share), and what its replay held. Leaves torch's RNG
    where that build leaves it; collective."""
    from moebit.training.sharding import shard_model  # FSDP2: only sharded runs import it

    fam = family_of(mcfg)
    model, record = record_build(lambda: fam.build(mcfg, device="meta"))
    wanted = targets(model, record)
    _quiet_fsdp()
    shard_model(model, scfg, device_type=torch.device(device).type)
    model.to_empty(device=device)
    return model, replay(record, model, wanted)


def build_sharded_run(cfg: TrainConfig, device: torch.device | str) -> Any | None:
    """A sharded run's model, with no rank holding it whole: fresh (``build_sharded``), or
    empty and read from ``--init-from``'s safetensors, each rank its own rows; None for
    a model folder of a family without that reader (built whole, then sharded)."""
    mcfg = cfg.model_config()
    if not cfg.init_from:
        return build_sharded(mcfg, shard_config(cfg), device)[0]
    if not isinstance(mcfg, HFDecoderConfig):
        return None
    from moebit.training.shard_init import load_hf_sharded

    model = build_sharded_empty(mcfg, shard_config(cfg), device)
    load_hf_sharded(model, str(cfg.init_from))
    return model
