"""Top-k router: which experts each token goes to, with what weight, and which survive capacity.

The router is a bias-free Linear(d_model, E) computed in float32 with autocast off: its
softmax decides discrete routes, and bf16 logits flip near-ties between experts from step
to step. Everything is returned in a `Routing` dataclass (never a tuple, never a global
list of losses), and the capacity / dropping logic is two pure functions,
`compute_capacity` and `select_kept`, so tests can drive them with hand-built routings.

Dropping never builds an [S, E] or [S, E, C] mask: the S*k (token, choice) pairs are
sorted by (expert, priority) and a pair survives when its rank inside its expert's block
is below the capacity. Priority puts every first choice before every second choice, and
inside one choice level orders tokens by position or by a random permutation (Random
Token Selection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moebit.moe.config import MoEConfig


@dataclass
class RoutingStats:
    """Detached router statistics for metrics (no autograd, no host sync until asked)."""

    tokens_per_expert: torch.Tensor  # [E] long: (token, choice) pairs routed to e, before drops
    kept_per_expert: torch.Tensor  # [E] long: pairs that e actually processes
    fraction_dropped: torch.Tensor  # scalar float: dropped pairs / all S*k pairs
    capacity: int | None  # slots per expert; None in dropless mode

    def to_dict(self) -> dict[str, object]:
        """Plain Python values for JSON metrics (this syncs with the device)."""
        return {
            "tokens_per_expert": self.tokens_per_expert.tolist(),
            "kept_per_expert": self.kept_per_expert.tolist(),
            "fraction_dropped": float(self.fraction_dropped),
            "capacity": self.capacity,
        }


@dataclass
class Routing:
    """The router's decision for S tokens: k (expert, weight, kept) triples per token."""

    expert_SK: torch.Tensor  # long, chosen experts, best first
    weight_SK: torch.Tensor  # float32 gate weights (differentiable w.r.t. the router)
    kept_SK: torch.Tensor  # bool, False where the pair overflowed its expert's capacity
    aux_loss: torch.Tensor  # scalar, load-balancing loss (not yet multiplied by its coef)
    z_loss: torch.Tensor  # scalar, mean(logsumexp(logits)^2) (not yet multiplied)
    stats: RoutingStats


def compute_capacity(
    num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int
) -> int:
    """Slots per expert: ceil(k*cf*S/E), at least min_capacity, never more than S.

    The clamp to S matters: with k*cf > E the formula exceeds the token count, and a
    capacity above S only pads (a known crash in implementations that allocate it).
    """
    cap = math.ceil(k * capacity_factor * num_tokens / num_experts)
    return min(max(cap, min_capacity), num_tokens)


def select_kept(
    expert_SK: torch.Tensor,
    num_experts: int,
    capacity: int,
    policy: str = "position",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Which (token, choice) pairs fit their expert's capacity: a bool [S, k] mask.

    All first choices are served before any second choice (and so on); within a choice
    level, "position" serves earlier tokens first and "random" serves tokens in a random
    order (Random Token Selection), so that late tokens of a sequence are not the ones
    always dropped.
    """
    s, k = expert_SK.shape
    n = s * k
    device = expert_SK.device
    expert_N = expert_SK.t().reshape(-1)  # choice-major: pair j*S + s
    if policy == "position":
        token_rank_S = torch.arange(s, device=device)
    elif policy == "random":
        token_rank_S = torch.randperm(s, device=device, generator=generator)
    else:
        raise ValueError(f"drop_policy must be 'position' or 'random', got {policy!r}")
    prio_N = (torch.arange(k, device=device).unsqueeze(1) * s + token_rank_S).reshape(-1)
    order_N = torch.argsort(expert_N * n + prio_N)
    expert_sorted_N = expert_N[order_N]
    counts_E = torch.bincount(expert_N, minlength=num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert_N = torch.arange(n, device=device) - starts_E[expert_sorted_N]
    kept_N = torch.empty(n, dtype=torch.bool, device=device)
    kept_N[order_N] = rank_in_expert_N < capacity
    return kept_N.view(k, s).t()


def load_balancing_loss(probs_SE: torch.Tensor, expert_SK: torch.Tensor) -> torch.Tensor:
    """E * sum_e (mean router probability of e) * (fraction of the S*k choices that are e).

    Equals 1 when routing is perfectly uniform; the gradient flows through the mean
    probabilities only (the fractions are counts). Computed on choices before dropping.
    """
    s, e = probs_SE.shape
    if s == 0:
        return probs_SE.sum() * 0.0
    k = expert_SK.shape[1]
    frac_E = torch.bincount(expert_SK.reshape(-1), minlength=e).to(probs_SE.dtype) / (s * k)
    return e * torch.dot(probs_SE.mean(0), frac_E)


def router_z_loss(logits_SE: torch.Tensor) -> torch.Tensor:
    """mean(logsumexp(logits)^2): keeps router logits small so the softmax stays stable."""
    if logits_SE.shape[0] == 0:
        return logits_SE.sum() * 0.0
    return torch.logsumexp(logits_SE, dim=-1).square().mean()


class TopKGate(nn.Module):
    """Router Linear(d_model, E, bias=False) + softmax + top-k + capacity."""

    def __init__(self, d_model: int, config: MoEConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.num_experts = config.num_experts
        self.k = config.num_experts_per_tok
        self.router = nn.Linear(d_model, config.num_experts, bias=False)

    def capacity(self, num_tokens: int) -> int | None:
        """Slots per expert for this many tokens in the current mode; None when dropless."""
        c = self.config
        if not c.drop_tokens:
            return None
        cf = c.capacity_factor if self.training else c.eval_capacity_factor
        return compute_capacity(num_tokens, self.num_experts, self.k, cf, c.min_capacity)

    def choose(
        self, x_SD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routing decision alone: float32 logits and probabilities [S, E], experts and
        weights [S, k]. No losses, capacity or statistics: decoding calls this directly,
        where those would cost about as much as the routing itself at a few tokens."""
        c = self.config
        noisy = self.training and c.noise != "none"
        with torch.autocast(device_type=x_SD.device.type, enabled=False):
            x32_SD = x_SD.float()
            if noisy and c.noise == "jitter":
                x32_SD = x32_SD * torch.empty_like(x32_SD).uniform_(0.99, 1.01)
            logits_SE = F.linear(x32_SD, self.router.weight.float())
            probs_SE = torch.softmax(logits_SE, dim=-1)
            if noisy and c.noise == "rsample":
                # Gumbel-max: -log(Exp(1)) is Gumbel(0, 1); noise only picks, weights stay probs.
                gumbel_SE = -torch.empty_like(logits_SE).exponential_().log()
                expert_SK = torch.topk(logits_SE.detach() + gumbel_SE, self.k, dim=-1).indices
                weight_SK = probs_SE.gather(1, expert_SK)
            else:
                weight_SK, expert_SK = torch.topk(probs_SE, self.k, dim=-1)
            if c.normalize_topk_weights and self.k > 1:
                weight_SK = weight_SK / weight_SK.sum(-1, keepdim=True).clamp_min(1e-9)
        return logits_SE, probs_SE, expert_SK, weight_SK

    def forward(self, x_SD: torch.Tensor) -> Routing:
        if x_SD.dim() != 2 or x_SD.shape[1] != self.router.in_features:
            raise ValueError(
                f"TopKGate expects tokens [S, {self.router.in_features}], got {tuple(x_SD.shape)}"
            )
        c = self.config
        logits_SE, probs_SE, expert_SK, weight_SK = self.choose(x_SD)
        with torch.autocast(device_type=x_SD.device.type, enabled=False):
            aux = load_balancing_loss(probs_SE, expert_SK)
            z = router_z_loss(logits_SE)

        s = x_SD.shape[0]
        cap = self.capacity(s)
        if cap is None:
            kept_SK = torch.ones_like(expert_SK, dtype=torch.bool)
        else:
            kept_SK = select_kept(expert_SK, self.num_experts, cap, c.drop_policy)
        with torch.no_grad():
            routed_E = torch.bincount(expert_SK.reshape(-1), minlength=self.num_experts)
            kept_E = torch.bincount(expert_SK[kept_SK], minlength=self.num_experts)
            n = expert_SK.numel()
            dropped = (n - kept_SK.sum()).to(torch.float32) / max(n, 1)
        stats = RoutingStats(routed_E, kept_E, dropped, cap)
        return Routing(expert_SK, weight_SK, kept_SK, aux, z, stats)
