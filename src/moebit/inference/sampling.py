"""The one sampler of decoding and serving: parameters, one token per row of logits, stops.

Every request (``moebit serve``) or prompt (``generate``) owns a ``torch.Generator`` and
samples its token from its own row of logits on the CPU, so a seeded request gives the
same text whatever else shares the batch.

Sampling stays finite for every value ``SamplingParams.check`` accepts: a temperature
below ``GREEDY_BELOW`` is greedy (dividing logits by 1e-40 overflows to inf, and softmax
of inf is NaN), top-p keeps at least the most likely token (a top_p of 1e-300 rounds to
0 in float32 and would otherwise drop every token), and a row whose probabilities are
still not a distribution (NaN or inf logits from the model) falls back to its argmax.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS too)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# find_stop's hold-back costs up to len(stop)^2 per token on the engine thread: a megabyte
# stop string would stall every request in the batch
MAX_STOP_CHARS = 256


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): every token
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def check(self) -> None:
        """A ValueError whose first word is the bad field (the API reports it as ``param``)."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must lie in [0, 100], got {self.temperature}")
        if not math.isfinite(self.top_p):
            raise ValueError(f"top_p must be a finite number, got {self.top_p}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise ValueError("stop must hold at most 4 non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters long")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self) -> torch.Generator:
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        return torch.Generator().manual_seed(seed)


def sample(logits_V: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token id from one row of logits (float, CPU) under ``p``, drawn with ``gen``."""
    if p.greedy:
        return int(logits_V.argmax())
    logits_V = logits_V / p.temperature
    if 0 < p.top_k < logits_V.shape[-1]:
        kth = torch.topk(logits_V, p.top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    probs_V = torch.softmax(logits_V, dim=-1)
    if p.top_p < 1:
        sorted_V, order_V = probs_V.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p, and the first token always
        drop_V = sorted_V.cumsum(0) - sorted_V >= p.top_p
        drop_V[0] = False
        probs_V = torch.zeros_like(probs_V).scatter_(0, order_V, sorted_V.masked_fill(drop_V, 0))
    total = float(probs_V.sum())
    if not math.isfinite(total) or total <= 0 or not bool(torch.isfinite(probs_V).all()):
        return int(torch.nan_to_num(logits_V, nan=float("-inf")).argmax())
    return int(torch.multinomial(probs_V, 1, generator=gen))


def sample_rows(logits_RV: torch.Tensor, params: Sequence[SamplingParams],
                gens: Sequence[torch.Generator]) -> list[int]:
    """One token per row (row i under ``params[i]`` with ``gens[i]``): the greedy rows in
    one batched argmax (the same first maximum as one row's argmax), the others by
    ``sample``. Used by ``generate`` and by the server's engine alike."""
    logits_RV = logits_RV.detach().float().cpu()
    best = logits_RV.argmax(-1).tolist()
    if len(params) != len(best) or len(gens) != len(best):
        raise ValueError(f"sample_rows: {len(best)} rows of logits, {len(params)} params, "
                         f"{len(gens)} generators")
    if all(p.greedy for p in params):  # no row views to make: a decode step's usual case
        return best
    return [b if p.greedy else sample(row_V, p, g)
            for row_V, p, g, b in zip(logits_RV, params, gens, best, strict=True)]


def find_stop(text: str, stops: list[str]) -> tuple[int | None, int]:
    """(where the first stop string starts in ``text`` or None, how many characters at the
    end may still begin a stop string and must be held back from a stream)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return min(hits), 0
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return None, hold
