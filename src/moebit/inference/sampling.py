"""Per-request sampling: parameters, one token from a row of logits, stop strings.

Every request owns a ``torch.Generator`` seeded from its ``seed`` (or a random one), and
samples its token from its own row of logits on the CPU, so a seeded request gives the
same text whatever else shares the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


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
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must lie in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise ValueError("stop must hold at most 4 non-empty strings")

    def generator(self) -> torch.Generator:
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        return torch.Generator().manual_seed(seed)


def sample(logits_V: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token id from one row of logits (float, CPU) under ``p``, drawn with ``gen``."""
    if p.temperature == 0:
        return int(logits_V.argmax())
    logits_V = logits_V / p.temperature
    if 0 < p.top_k < logits_V.shape[-1]:
        kth = torch.topk(logits_V, p.top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    probs_V = torch.softmax(logits_V, dim=-1)
    if p.top_p < 1:
        sorted_V, order_V = probs_V.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always)
        drop_V = sorted_V.cumsum(0) - sorted_V >= p.top_p
        probs_V = torch.zeros_like(probs_V).scatter_(0, order_V, sorted_V.masked_fill(drop_V, 0))
    return int(torch.multinomial(probs_V, 1, generator=gen))


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
