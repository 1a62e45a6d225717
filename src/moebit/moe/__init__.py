"""Mixture-of-Experts layers: top-k gating, sort-based dispatch, expert parallelism.

    from moebit.moe import MoE, MoEConfig
    moe = MoE(d_model=512, config=MoEConfig(num_experts=8, num_experts_per_tok=2))
    out = moe(x_BTD)                  # out.hidden, out.aux_loss, out.z_loss, out.stats
"""

from moebit.moe.config import MoEConfig
from moebit.moe.dispatch import DispatchPlan, permute, plan_dispatch, unpermute
from moebit.moe.experts import Experts
from moebit.moe.gate import (
    Routing,
    RoutingStats,
    TopKGate,
    compute_capacity,
    load_balancing_loss,
    router_z_loss,
    select_kept,
)
from moebit.moe.layer import MoE, MoEOutput, ResidualMoE, build_moe
from moebit.moe.mlp import MLP
from moebit.moe.overlap import overlapped_apply
from moebit.moe.parallel import (
    EPGroups,
    all_to_all,
    allreduce_grads_,
    expert_parallel_apply,
    expert_parallel_groups,
    is_expert_param,
    split_params_for_ep,
)

__all__ = [
    "MLP", "DispatchPlan", "EPGroups", "Experts", "MoE", "MoEConfig", "MoEOutput",
    "ResidualMoE", "Routing", "RoutingStats", "TopKGate", "all_to_all", "allreduce_grads_",
    "build_moe", "compute_capacity", "expert_parallel_apply", "expert_parallel_groups",
    "is_expert_param", "load_balancing_loss", "permute", "plan_dispatch", "router_z_loss",
    "overlapped_apply", "select_kept", "split_params_for_ep", "unpermute",
]
