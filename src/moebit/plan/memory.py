"""Per-rank memory of a training configuration, replicated or sharded (``moebit plan memory``).

Counted exactly from the model built on the meta device (no storage): dense and expert
parameters, each decoder block's size. Per rank, in bytes:

* parameters, gradients: 4 per parameter (fp32 masters), experts split over ``ep_size``;
  sharded: everything split again over the shard group (fsdp: the world; hsdp: a node);
* optimizer state: Adam / LAMB 8 per parameter (two fp32 moments); the 1-bit optimizers
  also keep an fp32 worker error (4) and a server error chunk (4 / world), and refuse
  sharding;
* gathered (sharded only): the unsharded weights FSDP gathers for the running block and
  the prefetched next one (``param_dtype``), and one block's unsharded gradient before
  its reduce-scatter (``reduce_dtype``); without ``reshard_after_forward`` every block's
  gathered weights stay until backward; with ``shard_unit`` "model" the whole gathered
  model and its whole unsharded gradient (one unit);
* activations: about 32 x d_model floats per token and layer kept for backward
  (``moebit.cli.validate``'s launcher estimate), not sharded;
* base: a rank's own footprint (interpreter, torch, gloo buffers).

``state`` (parameters + gradients + optimizer) is what the loop measures as
``state_bytes_per_rank``; docs/benchmarks/sharding.md compares the two.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moebit.models.meta import on_meta
from moebit.models.registry import family_of
from moebit.moe import is_expert_param
from moebit.plan.spec import SpecError
from moebit.training.config import TrainConfig
from moebit.training.shard_memory import size_bytes

BASE_BYTES = 350 << 20
OPTIMIZER_BYTES = {"adam": 8.0, "lamb": 8.0}
ONEBIT = ("onebit_adam", "zero_one_adam", "onebit_lamb")
_DTYPE_BYTES = {None: 4, "fp32": 4, "bf16": 2, "fp16": 2}


def parse_size(text: str, what: str = "--memory-per-rank") -> int:
    """Bytes of ``24GiB``, ``1.5GB``, ``512MiB`` or a plain number; else a SpecError."""
    try:
        return size_bytes(text, what)
    except ValueError as e:
        raise SpecError(str(e)) from None


@dataclass(frozen=True)
class RankMemory:
    shard: str
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    base: int

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.gathered + self.activations + self.base

    def to_dict(self) -> dict[str, int | str]:
        return {**asdict(self), "state": self.state, "total": self.total}


@dataclass(frozen=True)
class Counts:
    dense: int  # parameters outside the experts
    experts: int  # all experts of all layers (global)
    blocks: tuple[tuple[int, int], ...]  # each decoder block: (dense, expert) parameters
    d_model: int
    layers: int


def count(cfg: TrainConfig) -> Counts:
    """Parameter counts of the run's model, on the meta device."""
    mcfg = cfg.model_config()
    fam = family_of(mcfg)
    with on_meta():
        meta = fam.build(fam.with_ep_size(mcfg, 1), device="meta")
    dense = sum(p.numel() for p in meta.parameters() if not is_expert_param(p))
    experts = sum(p.numel() for p in meta.parameters() if is_expert_param(p))
    blocks = tuple((sum(p.numel() for p in b.parameters() if not is_expert_param(p)),
                    sum(p.numel() for p in b.parameters() if is_expert_param(p)))
                   for b in meta.blocks)
    head = getattr(meta, "lm_head", None)
    d = head.in_features if isinstance(head, torch.nn.Linear) else 1024
    return Counts(dense, experts, blocks, d, len(blocks))


def rank_memory(cfg: TrainConfig, counts: Counts, world: int, node: int, shard: str
                ) -> RankMemory:
    """The per-rank bytes of ``cfg`` under ``shard`` on ``world`` ranks of ``node`` per node."""
    ep = cfg.moe.ep_size if cfg.moe else 1
    if shard == "none":
        kept = counts.dense + counts.experts / ep
    else:  # experts: E / ep local ones over efsdp = group / ep ranks, i.e. E / group
        kept = (counts.dense + counts.experts) / (world if shard == "fsdp" else node)
    opt = OPTIMIZER_BYTES.get(cfg.optimizer, 8.0)
    if cfg.optimizer in ONEBIT:
        opt += 4.0 + 4.0 / world
    gathered = 0
    if shard != "none":
        units = [d + e / ep for d, e in counts.blocks]
        biggest = max(units)
        p_bytes, r_bytes = _DTYPE_BYTES[cfg.param_dtype], _DTYPE_BYTES[cfg.reduce_dtype]
        if cfg.shard_unit == "model":  # one unit: the gathered model, its whole gradient
            whole = counts.dense + counts.experts / ep
            gathered = int(whole * (p_bytes + r_bytes))
        else:
            held = 2 * biggest if cfg.reshard_after_forward else sum(units) + biggest
            gathered = int(held * p_bytes + biggest * r_bytes)
    block = cfg.model_config().block_size
    activations = cfg.batch_size * block * 32 * counts.d_model * counts.layers * 4
    return RankMemory(shard, int(kept * 4), int(kept * 4), int(kept * opt), gathered,
                      activations, BASE_BYTES)


def plan_memory(cfg: TrainConfig, world: int, node: int) -> list[RankMemory]:
    """Replicated, and the configuration's shard (fsdp when it has none; hsdp too on more
    than one node), per rank."""
    counts = count(cfg)
    modes = ["none", cfg.shard if cfg.shard != "none" else "fsdp"]
    if node < world and "hsdp" not in modes:
        modes.append("hsdp")
    return [rank_memory(cfg, counts, world, node, m) for m in modes]


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_memory(rows: list[RankMemory], world: int, limit: int | None) -> str:
    head = ["shard", "params", "grads", "optimizer", "gathered", "activations", "base", "total",
            "fits" if limit else ""]
    body = [[r.shard] + [gib(getattr(r, k)) for k in head[1:8]] +
            [("yes" if r.total <= limit else "no") if limit else ""] for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [head, *body]]
    return f"per-rank memory on {world} ranks (predicted)\n" + "\n".join(lines)
