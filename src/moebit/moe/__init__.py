"""Mixture-of-Experts layers: top-k gating, sort-based dispatch, expert parallelism.

    from moebit.moe import MoE, MoEConfig
    moe = MoE(d_model=512, config=MoEConfig(num_experts=8, num_experts_per_tok=2))
    out = moe(x_BTD)                  # out.hidden, out.aux_loss, out.z_loss, out.stats
    y_SD = moe.infer(x_SD)            # inference: dropless, no losses or statistics

    MoEConfig(expert_type="swiglu", num_shared_experts=1, shared_expert_gate=True,
              kernel="auto")          # modern blocks (docs/moe.md)
"""

from moebit.moe.balance import biased_gates, load_imbalance, router_metrics, update_router_biases_
from moebit.moe.config import MoEConfig
from moebit.moe.dense import MLP, GatedMLP, dense_expert
from moebit.moe.dispatch import DispatchPlan, permute, plan_dispatch, unpermute
from moebit.moe.experts import Experts
from moebit.moe.gate import (
    Routing,
    RoutingStats,
    TopKGate,
    compute_capacity,
    group_limited_mask,
    load_balancing_loss,
    router_z_loss,
    select_kept,
    seq_load_balancing_loss,
)
from moebit.moe.grouped import grouped_mm_supported
from moebit.moe.layer import MoE, MoEOutput, ResidualMoE, build_moe
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
    "MLP", "DispatchPlan", "EPGroups", "Experts", "GatedMLP", "MoE", "MoEConfig", "MoEOutput",
    "ResidualMoE", "Routing", "RoutingStats", "TopKGate", "all_to_all", "allreduce_grads_",
    "build_moe", "compute_capacity", "dense_expert", "expert_parallel_apply",
    "expert_parallel_groups", "grouped_mm_supported", "is_expert_param", "load_balancing_loss",
    "permute", "plan_dispatch", "router_z_loss", "select_kept", "split_params_for_ep",
    "overlapped_apply", "unpermute",
    # routing: DeepSeek-V3 groups, sequence-wise loss, aux-loss-free balancing
    "biased_gates", "group_limited_mask", "load_imbalance", "router_metrics",
    "seq_load_balancing_loss", "update_router_biases_",
]
