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

``--init-from HF_DIR`` keeps its own path (``shard_init``: each rank reads its rows of
the safetensors); a run whose hooks change the built model (``init_model``: a distilled
student copied from its teacher) builds whole, as before, since the hook needs the
whole model.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

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
