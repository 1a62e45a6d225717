"""`MoE` and `ResidualMoE`: drop-in feed-forward blocks returning a named output.

The GPT block's feed-forward contract: ``forward(x [B, T, d] or [S, d])`` returns an object
with ``.hidden`` (same shape as x) and ``.aux_loss`` (a scalar tensor to add to the
training loss). Losses travel on the output, never through a global list, so two models
in one process (teacher and student in distillation) cannot mix their losses.

    moe = MoE(512, MoEConfig(num_experts=8, num_experts_per_tok=2))
    out = moe(x_BTD)
    loss = lm_loss + out.aux_loss
    y_SD = moe.infer(x_SD)            # decoding: dropless, no losses, no statistics

Shared experts (``num_shared_experts``, Qwen2-MoE / DeepSeek) are a dense MLP beside the
routed experts, summed with their output, optionally scaled per token by Qwen2-MoE's
``sigmoid(shared_expert_gate(x))``. Residual MoE is the other way to mix one dense expert
in: a learned two-way softmax between it and the routed output (``residual=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moebit.comm import collectives
from moebit.moe.config import MoEConfig
from moebit.moe.dense import dense_expert
from moebit.moe.dispatch import DispatchPlan, permute, plan_dispatch, unpermute
from moebit.moe.experts import Experts
from moebit.moe.gate import RoutingStats, TopKGate
from moebit.moe.overlap import overlapped_apply
from moebit.moe.parallel import EPGroups, expert_parallel_apply


@dataclass
class MoEOutput:
    hidden: torch.Tensor  # same shape as the input
    aux_loss: torch.Tensor  # router_aux_loss_coef * balance_loss + router_z_loss_coef * z_loss
    balance_loss: torch.Tensor  # the load-balancing loss itself (1.0 = uniform routing)
    z_loss: torch.Tensor  # the router z-loss itself
    stats: RoutingStats  # tokens per expert, fraction dropped, capacity


class MoE(nn.Module):
    """Top-k gated experts with sort-based dispatch, optionally expert-parallel.

    With ``config.ep_size > 1`` pass ``ep_groups`` from ``expert_parallel_groups(ep_size)``
    (created once per process, shared by all layers); this rank then holds experts
    [ep_rank * E/ep_size, (ep_rank + 1) * E/ep_size).
    """

    def __init__(self, d_model: int, config: MoEConfig, ep_groups: EPGroups | None = None):
        super().__init__()
        config.validate()
        self.config = config
        self.d_model = d_model
        ep = config.ep_size
        ep_rank = 0
        if ep > 1:
            if ep_groups is None:
                raise ValueError(
                    f"ep_size = {ep} needs ep_groups: call "
                    "moebit.moe.expert_parallel_groups(ep_size) once and pass it to every layer"
                )
            if ep_groups.ep_size != ep or collectives.world_size(ep_groups.ep_group) != ep:
                raise ValueError(
                    f"ep_groups were made for ep_size = {ep_groups.ep_size} "
                    f"(group of {collectives.world_size(ep_groups.ep_group)} ranks), config has {ep}"
                )
            ep_rank = collectives.rank(ep_groups.ep_group)
        self.ep_groups = ep_groups if ep > 1 else None
        self.gate = TopKGate(d_model, config)
        n_local = config.num_local_experts
        self.experts = Experts(
            config.num_experts, d_model, config.ffn_size(d_model),
            first_expert=ep_rank * n_local, num_local=n_local,
            expert_type=config.expert_type, bias=config.has_expert_bias, kernel=config.kernel,
            act=config.expert_act,
        )
        self.experts.grad_scale = 1.0 / ep
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.num_shared_experts and not config.residual:  # ResidualMoE owns its MLP
            self.shared_expert = dense_expert(d_model, config.shared_ffn_size(d_model),
                                              config.expert_type, config.has_expert_bias)
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(d_model, 1, bias=False)

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.d_model or x.dim() not in (2, 3):
            raise ValueError(f"MoE expects [B, T, {self.d_model}] or [S, {self.d_model}], "
                             f"got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> MoEOutput:
        self._check(x)
        x_SD = x.reshape(-1, self.d_model)
        routing = self.gate(x_SD, seq_len=x.shape[1] if x.dim() == 3 else None)
        plan = plan_dispatch(
            routing.expert_SK, routing.weight_SK, routing.kept_SK, self.config.num_experts
        )
        out_SD = self._combine(x_SD, plan)
        c = self.config
        aux = c.router_aux_loss_coef * routing.aux_loss + c.router_z_loss_coef * routing.z_loss
        return MoEOutput(out_SD.view(x.shape), aux, routing.aux_loss, routing.z_loss,
                         routing.stats)

    def infer(self, x_SD: torch.Tensor) -> torch.Tensor:
        """The layer's output for tokens [S, d] at inference: dropless, no losses, no statistics.

        Routing is ``TopKGate.choose`` (no capacity, no noise in eval mode); dispatch,
        experts, all-to-all and combine are the training path's. With expert parallelism
        every rank must call it (an empty [0, d] still takes part in the collectives).
        """
        self._check(x_SD)
        x2_SD = x_SD.reshape(-1, self.d_model)
        _, _, expert_SK, weight_SK = self.gate.choose(x2_SD)
        plan = plan_dispatch(expert_SK, weight_SK, None, self.config.num_experts)  # all kept
        return self._combine(x2_SD, plan).view(x_SD.shape)

    def _combine(self, x_SD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Routed experts on the plan's pairs, combined per token, plus the shared experts."""
        x_ND = permute(x_SD, plan)
        autocast = torch.is_autocast_enabled(x_SD.device.type)
        if self.ep_groups is not None:
            c = self.config
            if c.a2a_dtype == "auto" and autocast:
                # the experts compute in the autocast dtype anyway: send half the bytes
                x_ND = x_ND.to(torch.get_autocast_dtype(x_SD.device.type))
            if c.a2a_chunks > 1:
                y_ND = overlapped_apply(x_ND, plan.counts_E, self.experts, self.ep_groups.ep_group,
                                        c.a2a_chunks, c.a2a_dtype, c.a2a_grad_dtype)
            else:
                y_ND = expert_parallel_apply(x_ND, plan.counts_E, self.experts,
                                             self.ep_groups.ep_group, c.a2a_dtype,
                                             c.a2a_grad_dtype, self.ep_groups.hierarchy)
        else:
            y_ND = self.experts(x_ND, plan.counts)
        out_SD = unpermute(y_ND, plan)
        if self.shared_expert is not None:
            sh_SD = self.shared_expert(x_SD)
            if self.shared_expert_gate is not None:
                sh_SD = torch.sigmoid(self.shared_expert_gate(x_SD)) * sh_SD
            out_SD = out_SD + sh_SD
        return out_SD if autocast else out_SD.to(x_SD.dtype)


class ResidualMoE(nn.Module):
    """Residual MoE: a dense MLP beside an MoE, mixed per token: c0 * moe + c1 * mlp.

    The coefficients come from Linear(d, 2) + softmax on the token itself. The paper runs
    it with a top-1 MoE (top-2 quality at top-1 communication); other k work too. The MLP
    is one shared expert of the config's ``expert_type`` (``shared_ffn_size`` wide).
    """

    def __init__(self, d_model: int, config: MoEConfig, ep_groups: EPGroups | None = None):
        super().__init__()
        self.moe = MoE(d_model, config, ep_groups)
        self.mlp = dense_expert(d_model, config.shared_ffn_size(d_model), config.expert_type,
                                config.has_expert_bias)
        self.coef = nn.Linear(d_model, 2)

    @property
    def ep_groups(self) -> EPGroups | None:
        return self.moe.ep_groups

    def forward(self, x: torch.Tensor) -> MoEOutput:
        m = self.moe(x)
        c = torch.softmax(self.coef(x), dim=-1)
        hidden = m.hidden * c[..., 0:1] + self.mlp(x) * c[..., 1:2]
        return MoEOutput(hidden, m.aux_loss, m.balance_loss, m.z_loss, m.stats)

    def infer(self, x_SD: torch.Tensor) -> torch.Tensor:
        """Inference output for tokens [S, d] (``MoE.infer`` for the routed part)."""
        c = torch.softmax(self.coef(x_SD), dim=-1)
        return self.moe.infer(x_SD) * c[..., 0:1] + self.mlp(x_SD) * c[..., 1:2]


def build_moe(
    d_model: int, config: MoEConfig, ep_groups: EPGroups | None = None
) -> MoE | ResidualMoE:
    """``ResidualMoE`` when ``config.residual`` else ``MoE``."""
    cls = ResidualMoE if config.residual else MoE
    return cls(d_model, config, ep_groups)
