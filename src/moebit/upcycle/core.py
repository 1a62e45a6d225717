"""Sparse upcycling (Komatsuzaki et al. 2022), the algorithm every family shares.

Every expert of an MoE layer starts as a copy of that layer's dense MLP (plus optional
Gaussian noise on the weight matrices, so that the experts can drift apart sooner), and
the router starts near zero, N(0, router_std), so its top-k weights are nearly uniform.
Where a token's k weights sum to 1 and no token is dropped, identical experts give back
the dense MLP's output: the upcycled model computes what the dense one did, and training
continues from the dense model's loss instead of from scratch.

The families differ only in names and layouts (moebit's GPT stacks its experts [E, d, f];
Hugging Face folders hold one tensor per expert) and in what their routers' settings mean;
the front ends (``runs.py`` for a moebit run, ``hf_folder.py`` for a Hugging Face folder)
map those and call these functions.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch


@dataclass
class ExpertCopier:
    """Makes the experts and routers of one upcycling, from one seeded generator."""

    noise_std: float = 0.0
    router_std: float = 1e-3
    seed: int = 0
    gen: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_noise(self.noise_std, self.router_std)
        self.gen = torch.Generator().manual_seed(self.seed)

    def experts(self, w: torch.Tensor, num_experts: int, noisy: bool = True) -> torch.Tensor:
        """``num_experts`` copies of ``w`` stacked on dim 0 ([E, *w.shape]), in ``w``'s
        dtype; weight matrices get N(0, noise_std) noise (``noisy``), biases do not."""
        copies = w.float().unsqueeze(0).expand(num_experts, *w.shape).clone()
        if noisy and self.noise_std > 0:
            copies += self.noise_std * torch.randn(copies.shape, generator=self.gen)
        return copies.to(w.dtype)

    def router(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A router weight near zero: N(0, router_std)."""
        return (self.router_std * torch.randn(shape, generator=self.gen)).to(dtype)


def check_noise(noise_std: float, router_std: float) -> None:
    if noise_std < 0 or router_std < 0:
        raise ValueError("upcycle: noise_std and router_std must be >= 0")


def check_experts(num_experts: int, k: int) -> None:
    if num_experts < 1 or k < 1:
        raise ValueError(f"upcycle: num_experts ({num_experts}) and num_experts_per_tok ({k}) "
                         "must be >= 1")
    if num_experts < k:
        raise ValueError(f"upcycle: num_experts = {num_experts} < num_experts_per_tok = {k}: a "
                         "token cannot pick more experts than there are")


def starts_at_dense(weights_sum_to_one: bool, noise_std: float) -> bool:
    """Whether the upcycled model computes the dense one's outputs: the k weights sum to 1
    and no noise makes the experts differ."""
    return weights_sum_to_one and noise_std == 0


def warn_unless_dense(weights_sum_to_one: bool, noise_std: float) -> None:
    """Say why the upcycled model will not start at the dense model's outputs, if it won't."""
    if starts_at_dense(weights_sum_to_one, noise_std):
        return
    why = []
    if not weights_sum_to_one:
        why.append("the top-k gate weights do not sum to 1 (k = 1 with softmax before top-k, "
                   "norm_topk_prob off, or routed_scaling_factor != 1)")
    if noise_std:
        why.append(f"the experts are noised (noise_std {noise_std})")
    warnings.warn(f"upcycle: {' and '.join(why)}: the upcycled model starts away from the dense "
                  "model's outputs; see docs/moe-routing.md", stacklevel=3)
