"""The clamped SwiGLU of gpt-oss: ``(clamp(up) + shift) * g * sigmoid(alpha * g)``, g = min(gate, limit).

transformers' ``GptOssExperts._apply_gate`` with ``alpha`` 1.702, ``limit`` 7 and the
``up + 1`` form (shift 1). With alpha 1, no limit and shift 0 it is the plain SwiGLU
(``silu(gate) * up``). It is an activation of the expert kernels (``moebit.moe.kernels``
passes it where they pass the expert type), so the loop, padded, threaded and grouped
kernels, expert parallelism and the int8/int4 experts all run the same formula; its
backward is written out here (the kernels keep the gate's activation ``s`` as for SwiGLU).

Clamping passes the gradient where the input lies inside the bounds, ends included, as
``torch.clamp``'s backward does, so training matches an autograd graph of transformers' ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClampedSwiGLU:
    """The activation's constants (frozen and hashable: it travels through autograd ctx)."""

    alpha: float = 1.0
    limit: float | None = None
    up_shift: float = 0.0

    def __str__(self) -> str:  # the autotune key and reprs: one short stable name
        return f"swiglu(alpha={self.alpha:g},limit={self.limit},shift={self.up_shift:g})"


def glu_into(act: ClampedSwiGLU, a: torch.Tensor, u: torch.Tensor, h: torch.Tensor,
             s: torch.Tensor) -> None:
    """h = (clamp(u) + shift) * s with s = g * sigmoid(alpha * g), g = min(a, limit)."""
    g = a if act.limit is None else a.clamp(max=act.limit)
    torch.mul(g, torch.sigmoid(g * act.alpha), out=s)
    if act.limit is not None:
        u = u.clamp(-act.limit, act.limit)
    if act.up_shift:
        u = u + act.up_shift
    torch.mul(s, u, out=h)


def glu_backward_into(act: ClampedSwiGLU, gh: torch.Tensor, a: torch.Tensor, u: torch.Tensor,
                      s: torch.Tensor, ga: torch.Tensor, gu: torch.Tensor) -> None:
    """The gate and up gradients of ``glu_into`` for output gradient ``gh``."""
    lim = act.limit
    torch.mul(gh, s, out=gu)
    if lim is not None:
        gu.mul_((u >= -lim) & (u <= lim))
        u = u.clamp(-lim, lim)
    if act.up_shift:
        u = u + act.up_shift
    g = a if lim is None else a.clamp(max=lim)
    sig = torch.sigmoid(g * act.alpha)
    # d/dg [g * sig(alpha g)] = sig + alpha * g * sig * (1 - sig)
    dg = sig + act.alpha * g * sig * (1 - sig)
    torch.mul(gh * u, dg, out=ga)
    if lim is not None:
        ga.mul_(a <= lim)
