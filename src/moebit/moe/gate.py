"""Top-k router: which experts each token goes to, with what weight, and which survive capacity.

The router is a Linear(d_model, E) (bias-free unless ``router_bias``: gpt-oss) computed in
float32 with autocast off: its softmax decides discrete routes, and bf16 logits flip
near-ties between experts from step to step. Everything is returned in a `Routing`
dataclass (never a tuple, never a global list of losses), and the capacity / dropping
logic is two pure functions, `compute_capacity` and `select_kept`, so tests can drive them
with hand-built routings.

Dropping never builds an [S, E] or [S, E, C] mask: the S*k (token, choice) pairs are
sorted by (expert, priority) and a pair survives when its rank inside its expert's block
is below the capacity. Priority puts every first choice before every second choice, and
inside one choice level orders tokens by position or by a random permutation (Random
Token Selection).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
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
    score_bias: torch.Tensor | None = None  # [E] selection bias used (aux-loss-free), or None

    def to_dict(self) -> dict[str, object]:
        """Plain Python values for JSON metrics (this syncs with the device)."""
        out: dict[str, object] = {
            "tokens_per_expert": self.tokens_per_expert.tolist(),
            "kept_per_expert": self.kept_per_expert.tolist(),
            "fraction_dropped": float(self.fraction_dropped),
            "capacity": self.capacity,
        }
        if self.score_bias is not None:
            out["score_bias"] = self.score_bias.tolist()
        return out


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


def group_limited_mask(sel_SE: torch.Tensor, n_group: int, topk_group: int,
                       group_score: str = "top2_sum") -> torch.Tensor:
    """DeepSeek group-limited routing: a bool [S, E] mask of the experts a token may pick.

    The E experts form n_group consecutive groups; a group scores the sum of its best two
    selection scores (DeepSeek-V3; its best one when groups hold a single expert), or its
    best score alone (``group_score="max"``, DeepSeek-V2), and the token keeps the experts
    of its topk_group best groups. Ties between groups go to the lower index.
    """
    s, e = sel_SE.shape
    per_group = e // n_group
    grouped_SGP = sel_SE.view(s, n_group, per_group)
    best = 1 if group_score == "max" else min(2, per_group)
    group_SG = grouped_SGP.topk(best, dim=-1).values.sum(-1)
    best_SG = group_SG.topk(topk_group, dim=-1).indices
    keep_SG = torch.zeros_like(group_SG, dtype=torch.bool).scatter_(1, best_SG, True)
    return keep_SG.unsqueeze(-1).expand(s, n_group, per_group).reshape(s, e)


def seq_load_balancing_loss(
    probs_SE: torch.Tensor, expert_SK: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the batch loss of each sequence, averaged.

    Tokens are consecutive runs of ``seq_len`` (one sequence each). Like the batch-wise
    loss it equals 1 when every sequence spreads its choices uniformly; unlike it, a batch
    whose sequences each favour other experts is penalised.
    """
    s, e = probs_SE.shape
    if s == 0:
        return probs_SE.sum() * 0.0
    if s % seq_len:
        raise ValueError(f"{s} tokens do not split into sequences of seq_len = {seq_len}")
    b, k = s // seq_len, expert_SK.shape[1]
    seq_N = torch.arange(s, device=expert_SK.device).repeat_interleave(k) // seq_len
    counts_BE = torch.zeros(b * e, dtype=probs_SE.dtype, device=probs_SE.device)
    counts_BE.index_add_(0, seq_N * e + expert_SK.reshape(-1),
                         torch.ones(s * k, dtype=probs_SE.dtype, device=probs_SE.device))
    frac_BE = counts_BE.view(b, e) / (seq_len * k)
    mean_BE = probs_SE.view(b, seq_len, e).mean(1)
    return e * (mean_BE * frac_BE).sum(-1).mean()


class TopKGate(nn.Module):
    """Router Linear(d_model, E; a bias with ``router_bias``) + scoring + (group-limited) top-k + capacity.

    With ``bias_update_speed > 0`` the gate holds ``e_score_correction_bias`` [E] (a
    buffer: no gradient, saved in checkpoints), added to the scores for selection only,
    and counts the choices it makes in training mode in ``load_since_update`` until
    ``update_router_biases_`` consumes them after the optimizer step. With
    ``score_correction_bias`` alone it holds the bias without counting or moving it.
    """

    def __init__(self, d_model: int, config: MoEConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.num_experts = config.num_experts
        self.k = config.num_experts_per_tok
        self.router = nn.Linear(d_model, config.num_experts, bias=config.router_bias)
        on = config.bias_update_speed > 0
        e = config.num_experts
        held = on or config.score_correction_bias  # a checkpoint's fixed bias, or a moving one
        self.register_buffer("e_score_correction_bias", torch.zeros(e) if held else None)
        self.register_buffer("load_since_update",
                             torch.zeros(e, dtype=torch.long) if on else None, persistent=False)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """Casts keep the selection bias float32, as the router's logits are: in bfloat16 a
        bias of 0.1 moves in steps of 5e-4, enough to flip near-ties between experts (and
        transformers keeps GLM's bias in float32 too)."""
        super()._apply(fn, recurse)
        b = self.e_score_correction_bias
        if b is not None and b.dtype != torch.float32:
            self.e_score_correction_bias = b.float()
        return self

    def capacity(self, num_tokens: int) -> int | None:
        """Slots per expert for this many tokens in the current mode; None when dropless."""
        c = self.config
        if not c.drop_tokens:
            return None
        cf = c.capacity_factor if self.training else c.eval_capacity_factor
        return compute_capacity(num_tokens, self.num_experts, self.k, cf, c.min_capacity)

    def _plain(self) -> bool:
        """The GShard/Switch router: softmax, then top-k of the probabilities themselves."""
        c = self.config
        return (c.scoring_func == "softmax" and c.softmax_before_topk and c.n_group == 1
                and self.e_score_correction_bias is None)

    def _score(self, logits_SE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores top-k ranks, per-expert distribution the balance losses use), both [S, E].

        Softmax-first ranks probabilities, top-k-first ranks logits (the same order), and
        sigmoid ranks sigmoid scores, whose balance distribution is them normalised to 1.
        """
        c = self.config
        if c.scoring_func == "sigmoid":
            scores_SE = torch.sigmoid(logits_SE)
            return scores_SE, scores_SE / scores_SE.sum(-1, keepdim=True)
        probs_SE = torch.softmax(logits_SE, dim=-1)
        return (probs_SE if c.softmax_before_topk else logits_SE), probs_SE

    def _select(self, logits_SE: torch.Tensor, scores_SE: torch.Tensor) -> torch.Tensor:
        """The k experts per token [S, k]: top-k of the (noisy, biased, group-masked) scores."""
        c = self.config
        if self.training and c.noise == "rsample":
            # Gumbel-max: -log(Exp(1)) is Gumbel(0, 1); noise only picks, weights stay scores.
            gumbel_SE = -torch.empty_like(logits_SE).exponential_().log()
            noisy_SE = logits_SE.detach() + gumbel_SE
            sel_SE = noisy_SE if self._plain() else self._score(noisy_SE)[0]
        else:
            sel_SE = scores_SE.detach()
        if self.e_score_correction_bias is not None:
            sel_SE = sel_SE + self.e_score_correction_bias
        if c.n_group > 1 and c.groups_kept < c.n_group:
            keep_SE = group_limited_mask(sel_SE, c.n_group, c.groups_kept, c.group_score)
            sel_SE = sel_SE.masked_fill(~keep_SE, float("-inf"))
        return torch.topk(sel_SE, self.k, dim=-1).indices

    def choose(
        self, x_SD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routing decision alone: float32 logits and balance probabilities [S, E],
        experts and weights [S, k]. No losses, capacity or statistics: decoding calls this
        directly, where those would cost about as much as the routing itself at a few tokens.

        Weights come from the plain scores (never the selection bias): softmax
        probabilities, a softmax over the k chosen logits, or sigmoid scores; normalised to
        sum to 1 when ``norm_topk_prob`` (k > 1), then times routed_scaling_factor.
        """
        c = self.config
        dev = x_SD.device.type
        # entering autocast(enabled=False) costs more than a decode step's router matmul
        off = torch.autocast(device_type=dev, enabled=False) if torch.is_autocast_enabled(dev) \
            else nullcontext()
        with off:
            x32_SD = x_SD.float()
            if self.training and c.noise == "jitter":
                x32_SD = x32_SD * torch.empty_like(x32_SD).uniform_(0.99, 1.01)
            b = self.router.bias
            logits_SE = F.linear(x32_SD, self.router.weight.float(), None if b is None else b.float())
            scores_SE, probs_SE = self._score(logits_SE)
            expert_SK = self._select(logits_SE, scores_SE)
            weight_SK = scores_SE.gather(1, expert_SK)
            if not c.softmax_before_topk:
                weight_SK = torch.softmax(weight_SK, dim=-1)
            elif c.norm_topk_prob and self.k > 1:
                weight_SK = weight_SK / weight_SK.sum(-1, keepdim=True).clamp_min(1e-9)
            if c.routed_scaling_factor != 1.0:
                weight_SK = weight_SK * c.routed_scaling_factor
        return logits_SE, probs_SE, expert_SK, weight_SK

    def forward(self, x_SD: torch.Tensor, seq_len: int | None = None) -> Routing:
        """Route tokens [S, d]; ``seq_len`` (tokens per sequence, S a multiple of it) is
        needed by the sequence-wise balance loss only (None: the S tokens are one sequence)."""
        if x_SD.dim() != 2 or x_SD.shape[1] != self.router.in_features:
            raise ValueError(
                f"TopKGate expects tokens [S, {self.router.in_features}], got {tuple(x_SD.shape)}"
            )
        c = self.config
        logits_SE, probs_SE, expert_SK, weight_SK = self.choose(x_SD)
        s = x_SD.shape[0]
        with torch.autocast(device_type=x_SD.device.type, enabled=False):
            if c.seq_aux:
                aux = seq_load_balancing_loss(probs_SE, expert_SK, seq_len or max(s, 1))
            else:
                aux = load_balancing_loss(probs_SE, expert_SK)
            z = router_z_loss(logits_SE)

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
            bias_E = None
            if self.e_score_correction_bias is not None:
                bias_E = self.e_score_correction_bias.clone()
                if self.training and self.load_since_update is not None:
                    self.load_since_update += routed_E
        stats = RoutingStats(routed_E, kept_E, dropped, cap, bias_E)
        return Routing(expert_SK, weight_SK, kept_SK, aux, z, stats)
