"""Sharded data parallelism with FSDP2: parameters, gradients and optimizer state split
over ranks, experts over expert parallel x expert data parallel.

    cfg = ShardConfig(shard="fsdp", rs_compress="int8")
    model = shard_model(model, cfg)          # every rank, after the model is built
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # the state is sharded too
    loss = model(x, y).loss; loss.backward(); opt.step()   # gradients come averaged

Layout (torchtitan's):

* ``fsdp``: one mesh dimension ``dp_shard`` over all ranks.
* ``hsdp``: ``[dp_replicate, dp_shard]``: shard inside a node of LOCAL_WORLD_SIZE ranks,
  replicate across nodes (gradients: reduce-scatter inside the node, then an allreduce
  of the shards across nodes).
* ``fsdp`` with ``node_local`` (an outer optimizer, DiLoCo, syncs the nodes): the mesh
  ``[outer, dp_shard]`` of which each rank uses its node's ``dp_shard`` row only, so
  every node shards one independent replica and nothing crosses nodes in a step.
* experts (expert parallel size ep > 1): rank r = f * ep + e holds the experts of ep rank
  e (moebit's consecutive ep groups); each expert module is its own ``fully_shard`` unit
  on the ``efsdp`` dimension of the mesh ``[(dp_replicate,) efsdp, ep]``, i.e. over the
  expert-data-parallel group (world / ep ranks; inside the node for hsdp), sharding dim
  0 (the local experts). ``Experts.grad_scale = 1 / ep`` and the efsdp mean give the
  world mean, as the replicated path does.

One unit per decoder block (``model.blocks``), each expert module before its block, then
the root (embeddings, final norm, head). Reductions are forced to SUM and divided
afterwards: the divide is exact on every backend (pytorch #162338 reports AVG wrong on
gloo in some setups), and the compressed reduce-scatters of ``shard_comm`` sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from moebit.moe import is_expert_param
from moebit.training.shard_comm import (
    CompressedAllGather,
    CompressedReduceScatter,
    replicate_allreduce_counter,
)
from moebit.training.shard_config import ShardConfig, check_layout


@dataclass(frozen=True)
class ShardMeshes:
    """The meshes of one sharded model (every rank builds them together).

    ``experts_rows`` views each global stacked expert tensor [E, ...] as split along dim
    0 over ranks in (ep rank, efsdp rank) order (replicated over dp_replicate for hsdp):
    the checkpoint and export layout, independent of the ep x efsdp split.
    """

    shard: str
    dense: DeviceMesh
    experts: DeviceMesh | None
    experts_rows: DeviceMesh | None
    ep_size: int
    replica: int = 0  # node_local: this rank's node, one of ``replicas`` independent replicas
    replicas: int = 1

    @property
    def expert_shard_size(self) -> int:
        """Ranks one expert module is sharded over (the efsdp dimension)."""
        return 1 if self.experts is None else self.experts.size(self.experts.ndim - 1)


def make_meshes(cfg: ShardConfig, ep_size: int = 1, device_type: str = "cpu") -> ShardMeshes:
    """The dense and expert meshes for ``cfg`` over the default group; collective.

    Raises ValueError naming the impossible layout (``check_layout``), or the missing
    process group, before any rank creates a group.
    """
    if cfg.shard == "none":
        raise ValueError("make_meshes: shard is none, there is nothing to shard")
    if not dist.is_initialized():
        raise ValueError(f"shard={cfg.shard} needs torch.distributed initialised (torchrun)")
    world = dist.get_world_size()
    lay = check_layout(cfg, world, ep_size)
    if cfg.node_local:
        return _node_local_meshes(cfg, lay.nodes, lay.node, ep_size, device_type)
    if cfg.shard == "hsdp":
        dense = init_device_mesh(device_type, (lay.nodes, lay.node),
                                 mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        dense = init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))
    if ep_size == 1:
        return ShardMeshes(cfg.shard, dense, None, None, 1)
    nodes, efsdp = lay.nodes, lay.efsdp
    ranks = torch.arange(world)
    if cfg.shard == "hsdp":
        full = DeviceMesh(device_type, ranks.view(nodes, efsdp, ep_size),
                          mesh_dim_names=("dp_replicate", "efsdp", "ep"))
        experts = full["dp_replicate", "efsdp"]
    else:
        full = DeviceMesh(device_type, ranks.view(efsdp, ep_size), mesh_dim_names=("efsdp", "ep"))
        experts = full["efsdp"]
    # rows mesh: for node n, ranks ordered by (ep rank e, efsdp rank f): n*node + f*ep + e
    rows = _rows(ranks, nodes, efsdp, ep_size)
    if cfg.shard == "hsdp":
        experts_rows = DeviceMesh(device_type, rows, mesh_dim_names=("dp_replicate", "rows"))
    else:
        experts_rows = DeviceMesh(device_type, rows.reshape(world), mesh_dim_names=("rows",))
    return ShardMeshes(cfg.shard, dense, experts, experts_rows, ep_size)


def _rows(ranks: torch.Tensor, nodes: int, efsdp: int, ep_size: int) -> torch.Tensor:
    """[nodes, node]: each node's ranks ordered by (ep rank e, efsdp rank f)."""
    return ranks.view(nodes, efsdp, ep_size).transpose(1, 2).reshape(nodes, efsdp * ep_size)


def _node_local_meshes(cfg: ShardConfig, nodes: int, node: int, ep_size: int,
                       device_type: str) -> ShardMeshes:
    """One fsdp layout per node (``node_local``): every rank makes the meshes of all nodes
    (group creation is collective) and keeps its own node's rows, so the dense and expert
    meshes, and the checkpoint's expert rows, are those of an fsdp run on one node."""
    world = nodes * node
    replica = dist.get_rank() // node
    dense = init_device_mesh(device_type, (nodes, node),
                             mesh_dim_names=("outer", "dp_shard"))["dp_shard"]
    if ep_size == 1:
        return ShardMeshes(cfg.shard, dense, None, None, 1, replica, nodes)
    efsdp = node // ep_size
    ranks = torch.arange(world)
    full = DeviceMesh(device_type, ranks.view(nodes, efsdp, ep_size),
                      mesh_dim_names=("outer", "efsdp", "ep"))
    rows = DeviceMesh(device_type, _rows(ranks, nodes, efsdp, ep_size),
                      mesh_dim_names=("outer", "rows"))
    return ShardMeshes(cfg.shard, dense, full["efsdp"], rows["rows"], ep_size, replica, nodes)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules whose own parameters are all expert parameters (``Experts``), by name."""
    found = []
    for name, m in model.named_modules():
        own = list(m.parameters(recurse=False))
        if own and all(is_expert_param(p) for p in own):
            found.append((name, m))
        elif any(is_expert_param(p) for p in own):
            raise ValueError(f"module {name!r} mixes expert and dense parameters: it cannot "
                             f"be sharded over two meshes")
    return found


def _model_ep_size(model: nn.Module) -> int:
    groups = getattr(model, "ep_groups", None)
    return 1 if groups is None else int(groups.ep_size)


def _check_experts(model: nn.Module, meshes: ShardMeshes) -> None:
    """The model's expert-dp group must be the mesh's efsdp group, and the local experts
    must split evenly over it (the checkpoint's row layout needs equal pieces)."""
    groups = getattr(model, "ep_groups", None)
    if meshes.experts is None or groups is None:
        return
    mesh_ranks = tuple(sorted(int(r) for r in meshes.experts.mesh.flatten().tolist()))
    want = sorted(groups.expert_dp_ranks)
    if meshes.replicas > 1:  # node_local: the node's share of the expert-data-parallel group
        node = {int(r) for r in meshes.dense.mesh.flatten().tolist()}
        want = [r for r in want if r in node]
    if mesh_ranks != tuple(want):
        raise ValueError(f"the model's expert-data-parallel ranks {groups.expert_dp_ranks} "
                         f"are not the expert mesh's {mesh_ranks}")
    efsdp = meshes.expert_shard_size
    for name, m in expert_modules(model):
        for pname, p in m.named_parameters(recurse=False):
            if p.shape[0] % efsdp:
                raise ValueError(f"{name}.{pname}: {p.shape[0]} local experts do not split over "
                                 f"the {efsdp} expert-data-parallel ranks; choose ep_size so "
                                 f"that (num_experts / ep_size) % (world / ep_size) == 0")


@dataclass
class ShardState:
    """What ``shard_model`` leaves on the model (``model.moebit_shard``): the config, the
    meshes, the names of the expert parameters and each unit's reduce-scatter, in unit
    order (the checkpoint needs them: the int8 residuals live there)."""

    config: ShardConfig
    meshes: ShardMeshes
    expert_names: tuple[str, ...]
    reduce_scatters: tuple[CompressedReduceScatter, ...] = ()
    all_gathers: tuple[CompressedAllGather, ...] = ()

    def transports(self) -> dict[str, list[str]]:
        """The exact collectives' transports chosen so far (``shard_transport``), by kind."""
        return {kind: sorted({c for u in units for c in u.transport.chosen.values()})
                for kind, units in (("rs", self.reduce_scatters), ("ag", self.all_gathers))}


def shard_model(model: nn.Module, cfg: ShardConfig, meshes: ShardMeshes | None = None,
                device_type: str | None = None) -> nn.Module:
    """Apply FSDP2 to ``model`` in place (returned for chaining); collective.

    ``model.blocks`` must hold the decoder blocks (moebit's GPT and HFDecoder do). With
    ``cfg.shard == "none"`` the model is returned untouched. The model must be on its
    final device, or on the meta device with ``device_type`` naming the final one (then
    ``to_empty`` gives each rank its shards: ``moebit.training.shard_build``), with
    expert-parallel groups already made (``model.ep_groups``).
    """
    if cfg.shard == "none":
        return model
    if getattr(model, "moebit_shard", None) is not None:
        raise ValueError("shard_model: the model is already sharded")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"shard_model: {type(model).__name__} has no .blocks ModuleList "
                         f"of decoder blocks to shard one by one")
    device_type = device_type or next(model.parameters()).device.type
    if device_type == "meta":
        raise ValueError("shard_model: the model is on the meta device; pass device_type, "
                         "the device its shards will live on")
    meshes = meshes or make_meshes(cfg, _model_ep_size(model), device_type)
    if meshes.ep_size != _model_ep_size(model):
        raise ValueError(f"meshes were made for ep_size={meshes.ep_size}, the model has "
                         f"{_model_ep_size(model)}")
    _check_experts(model, meshes)
    expert_names = tuple(n for n, p in model.named_parameters() if is_expert_param(p))
    common: dict[str, Any] = {"reshard_after_forward": cfg.reshard_after_forward,
                              "mp_policy": cfg.mp_policy()}
    units: list[tuple[FSDPModule, DeviceMesh]] = []
    experts = dict(expert_modules(model)) if meshes.experts is not None else {}
    if cfg.unit == "model":  # one unit per mesh: the experts of every block, then the rest
        if experts:  # one group over several modules: its hooks are set through any of them
            group = fully_shard(list(experts.values()), mesh=meshes.experts, **common)
            units.append((group[0], meshes.experts))
    else:
        for block in blocks:
            for m in block.modules():
                if any(m is e for e in experts.values()):
                    units.append((fully_shard(m, mesh=meshes.experts, **common),
                                  meshes.experts))
            units.append((fully_shard(block, mesh=meshes.dense, **common), meshes.dense))
    units.append((fully_shard(model, mesh=meshes.dense, **common), meshes.dense))
    comms = [_install_comms(unit, mesh, cfg) for unit, mesh in units]
    model.moebit_shard = ShardState(cfg, meshes, expert_names, tuple(rs for rs, _ in comms),
                                    tuple(ag for _, ag in comms))
    return model


def _install_comms(unit: FSDPModule, mesh: DeviceMesh, cfg: ShardConfig,
                   ) -> tuple[CompressedReduceScatter, CompressedAllGather]:
    """SUM reductions divided afterwards, the unit's own (compressed) collectives, and for
    hsdp a counter of the replicate-dim allreduce."""
    unit.set_force_sum_reduction_for_comms(True)
    rs = CompressedReduceScatter(cfg.rs_compress, cfg.quant_block, transport=cfg.transport)
    ag = CompressedAllGather(cfg.ag_compress, cfg.quant_block, transport=cfg.transport)
    unit.set_custom_reduce_scatter(rs)
    unit.set_custom_all_gather(ag)
    if mesh.ndim == 2 and mesh.size(0) > 1:
        unit.set_all_reduce_hook(replicate_allreduce_counter(mesh.size(0)))
    return rs, ag
