"""Aux-loss-free load balancing (DeepSeek-V3) and the router metrics of a training step.

Each gate with ``bias_update_speed > 0`` counts the expert choices it made since the
last optimizer step; ``update_router_biases_`` then moves every expert's selection bias
by ``bias_update_speed * sign(mean load - load_e)``: an overloaded expert becomes less
attractive, an idle one more. The loads are summed over the ranks that route different
tokens through the same gate before the update, so every replica applies the same
change and the biases stay bit-identical without ever being broadcast. With expert
parallelism each rank still routes its own tokens over all E experts, so that group is
the whole world.

    loss.backward(); opt.step()
    update_router_biases_(model)       # every rank, after every optimizer step
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from moebit.moe.gate import RoutingStats, TopKGate


def biased_gates(model: nn.Module) -> list[TopKGate]:
    """The gates of ``model`` that move their selection bias (``bias_update_speed > 0``;
    a fixed checkpoint bias, ``score_correction_bias`` alone, is not moved), in module order."""
    return [m for m in model.modules()
            if isinstance(m, TopKGate) and m.load_since_update is not None]


@torch.no_grad()
def update_router_biases_(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Apply one bias update to every biased gate of ``model``; returns how many gates.

    Call on every rank after each optimizer step (it is collective over ``group``, the
    ranks routing different tokens of the same layers: None = the world, right for data
    and expert parallelism alike). A gate that routed nothing since the last update
    (all loads 0) keeps its bias. Counts are reset afterwards.
    """
    gates = biased_gates(model)
    if not gates:
        return 0
    loads = torch.cat([g.load_since_update for g in gates])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    for g, load_E in zip(gates, loads.split([g.num_experts for g in gates]), strict=True):
        load_f = load_E.to(g.e_score_correction_bias.dtype)
        step = g.config.bias_update_speed * torch.sign(load_f.mean() - load_f)
        g.e_score_correction_bias.add_(step.to(g.e_score_correction_bias.device))
        g.load_since_update.zero_()
    return len(gates)


def load_imbalance(tokens_per_expert: torch.Tensor) -> float:
    """max / mean expert load (1.0 = perfectly even); 0.0 when nothing was routed."""
    t = tokens_per_expert.float()
    mean = float(t.mean())
    return float(t.max()) / mean if mean > 0 else 0.0


def router_metrics(stats: Sequence[RoutingStats]) -> dict[str, list]:
    """Per MoE layer: max/mean expert load, and the selection biases when balancing by bias."""
    out: dict[str, list] = {"load_max_over_mean": [load_imbalance(s.tokens_per_expert)
                                                   for s in stats]}
    if any(s.score_bias is not None for s in stats):
        out["router_bias"] = [[] if s.score_bias is None else s.score_bias.tolist()
                              for s in stats]
    return out
