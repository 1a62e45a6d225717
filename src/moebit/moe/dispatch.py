"""Sort-based dispatch: tokens grouped by expert with index gathers, combined with index_add_.

GShard-style layers build a one-hot [S, E, C] dispatch tensor and two einsums over it:
O(S*E*C*d) work and memory that grow with E, almost all of it multiplying by zero. Here
the kept (token, choice) pairs are sorted by expert once (O(S*k log(S*k))), the tokens
are gathered into one contiguous block per expert, and the expert outputs are added back
to their tokens weighted by the gate: O(S*k*d) data movement, nothing proportional to E
except a [E] count vector. The one-hot form lives only in the tests, as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchPlan:
    """Where each kept (token, choice) pair goes: N pairs in expert order."""

    token_N: torch.Tensor  # long, the source token of each pair, grouped by expert
    weight_N: torch.Tensor  # the gate weight of each pair (carries the router's gradient)
    counts_E: torch.Tensor  # long [E], pairs per expert (block sizes, in expert order)
    counts: list[int]  # counts_E on the host: slice bounds and all_to_all split sizes
    num_tokens: int  # S, rows of the combined output


def plan_dispatch(
    expert_SK: torch.Tensor,
    weight_SK: torch.Tensor,
    kept_SK: torch.Tensor | None,
    num_experts: int,
) -> DispatchPlan:
    """Sort the kept pairs by expert (stable, so earlier tokens stay first in a block).

    ``kept_SK`` None: every pair is kept (dropless decoding; skips a check and a host sync)."""
    s, k = expert_SK.shape
    expert_P = expert_SK.reshape(-1)  # token-major: pair index = s * k + j
    if kept_SK is None or bool(kept_SK.all()):
        expert_N, pair_N = torch.sort(expert_P, stable=True)  # one op: order and sorted ids
    else:
        sel_N = kept_SK.reshape(-1).nonzero().squeeze(1)
        order_N = torch.argsort(expert_P[sel_N], stable=True)
        pair_N = sel_N[order_N]
        expert_N = expert_P[pair_N]
    counts_E = torch.bincount(expert_N, minlength=num_experts)
    return DispatchPlan(
        token_N=torch.div(pair_N, k, rounding_mode="floor"),
        weight_N=weight_SK.reshape(-1).index_select(0, pair_N),
        counts_E=counts_E,
        counts=counts_E.tolist(),
        num_tokens=s,
    )


def permute(x_SD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Gather each kept pair's token row: [N, d], expert blocks contiguous, in expert order."""
    return x_SD.index_select(0, plan.token_N)


def unpermute(y_ND: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Add each pair's expert output, times its gate weight, back onto its token: [S, d].

    Tokens with every choice dropped get zeros (the residual connection carries them).
    """
    weighted_ND = y_ND * plan.weight_N.to(y_ND.dtype).unsqueeze(1)
    out_SD = y_ND.new_zeros(plan.num_tokens, y_ND.shape[1])
    return out_SD.index_add(0, plan.token_N, weighted_ND)
