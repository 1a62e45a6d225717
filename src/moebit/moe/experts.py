"""The E_local experts of one rank as batched weights, run block by block on sorted tokens.

Weights are one tensor per projection (w1 [E_local, d, f], b1 [E_local, f], w2 [E_local,
f, d], b2 [E_local, d]) rather than a ModuleList: one parameter per projection keeps
optimizer state, checkpoint resharding and expert-parallel slicing simple.

Two kernels, each one hand-written autograd node. ``_ExpertMLP`` loops over the experts'
contiguous blocks, one matmul per expert on exactly its rows. ``_ExpertMLPPadded`` pads
every block to the largest and runs the forward and input-gradient products as batched
matmuls, which the matmul library splits across threads by expert; that beats the loop
when the blocks are small and nearly equal, as they are under a capacity limit. Its weight
gradients still go expert by expert on the real rows: a bmm whose first operand is the
transposed [cap, f] activation runs at about 60% of the rate of per-expert mm calls
(E=64 experts of 128 rows, d 512, f 2048, 2 threads: 206 against 130 ms in float32, 78
against 47 ms in bfloat16). Measured on the whole layer (docs/benchmarks.md, 4096 tokens,
top-2 over 64 experts, capacity factor 1, 2 threads, medians of 5): forward+backward 954 ms
padded against 1036 ms for the loop in float32, 470 against 516 ms in bfloat16. Padding
costs FLOPs on zero rows and memory (about 80 MB more at peak there). With larger blocks
(E=8, 512-1024 rows) one matmul per block already keeps both threads busy, and with
skewed or dropless routing, for example every token sent to one expert, padding would
cost E x S rows, so ``Experts`` takes the padded path only when the blocks are small
and padding adds at most ``pad_limit`` (25%) of extra rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _ExpertMLP(torch.autograd.Function):
    """All local experts' GELU MLPs on their contiguous row blocks, one autograd node.

    Written by hand rather than as a loop of autograd ops because each weight gradient is
    computed straight into its slot of one [E_local, ...] gradient tensor: through autograd,
    the per-expert pieces would be stacked afterwards (an extra copy of every expert weight
    per step, about 0.5 GB at E=64, d=512, f=2048). The pre- and post-GELU activations
    are saved (recomputing the GELU backward would save memory but costs about 5% time).
    """

    @staticmethod
    def forward(ctx, x_ND, w1, b1, w2, b2, counts, grad_scale):  # type: ignore[override]
        n_rows, d = x_ND.shape
        out_ND = x_ND.new_empty(n_rows, d)
        hpre_NF = x_ND.new_empty(n_rows, w1.shape[2])
        h_NF = torch.empty_like(hpre_NF)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                torch.addmm(b1[e], x_ND[rows], w1[e], out=hpre_NF[rows])
                F.gelu(hpre_NF[rows], out=h_NF[rows])  # F.gelu is the aten op: takes out=
                torch.addmm(b2[e], h_NF[rows], w2[e], out=out_ND[rows])
                start += n
        ctx.save_for_backward(x_ND, w1, w2, hpre_NF, h_NF)
        ctx.counts, ctx.grad_scale = counts, grad_scale
        return out_ND

    @staticmethod
    def backward(ctx, g_ND):  # type: ignore[override]
        x_ND, w1, w2, hpre_NF, h_NF = ctx.saved_tensors
        g_ND = g_ND.contiguous()
        need_x = ctx.needs_input_grad[0]
        gx_ND = torch.empty_like(x_ND) if need_x else None
        gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
        gb1 = w1.new_empty(w1.shape[0], w1.shape[2])
        gb2 = w2.new_empty(w2.shape[0], w2.shape[2])
        start = 0
        for e, n in enumerate(ctx.counts):
            if not n:
                for t in (gw1, gw2, gb1, gb2):
                    t[e].zero_()
                continue
            rows = slice(start, start + n)
            start += n
            g_nD, hpre_nF = g_ND[rows], hpre_NF[rows]
            torch.mm(h_NF[rows].t(), g_nD, out=gw2[e])
            torch.sum(g_nD, 0, out=gb2[e])
            gh_nF = torch.ops.aten.gelu_backward(torch.mm(g_nD, w2[e].t()), hpre_nF)
            torch.mm(x_ND[rows].t(), gh_nF, out=gw1[e])
            torch.sum(gh_nF, 0, out=gb1[e])
            if need_x:
                torch.mm(gh_nF, w1[e].t(), out=gx_ND[rows])
        if ctx.grad_scale != 1.0:
            for t in (gw1, gb1, gw2, gb2):
                t.mul_(ctx.grad_scale)
        return gx_ND, gw1, gb1, gw2, gb2, None, None


def _padded_slots(counts: list[int], cap: int, device: torch.device) -> torch.Tensor:
    """Row of each sorted pair in an [E_local * cap] buffer: expert e's block starts at e * cap."""
    n = torch.tensor(counts, device=device)
    starts = torch.cumsum(n, 0) - n
    expert_N = torch.repeat_interleave(torch.arange(len(counts), device=device), n)
    return expert_N * cap + torch.arange(int(n.sum()), device=device) - starts[expert_N]


class _ExpertMLPPadded(torch.autograd.Function):
    """The same MLPs as ``_ExpertMLP``, as batched matmuls over blocks padded to the largest.

    One bmm over [E_local, cap, d] lets the matmul library split the work across threads
    by expert instead of inside each small [n, d] x [d, f] product. Padding rows are zeros
    in the input and get zero output gradients, so they add nothing to any gradient; they
    cost FLOPs and memory, which is why ``Experts`` picks this path only when the blocks are
    nearly equal (``Experts.pad_limit``).
    """

    @staticmethod
    def forward(ctx, x_ND, w1, b1, w2, b2, counts, grad_scale):  # type: ignore[override]
        n_exp, d = len(counts), x_ND.shape[1]
        cap = max(counts)
        full = all(c == cap for c in counts)
        slot_N = None if full else _padded_slots(counts, cap, x_ND.device)
        if full:
            x_ECD = x_ND.view(n_exp, cap, d)
        else:
            x_ECD = x_ND.new_zeros(n_exp * cap, d).index_copy_(0, slot_N, x_ND).view(n_exp, cap, d)
        hpre_ECF = torch.baddbmm(b1.unsqueeze(1), x_ECD, w1)
        h_ECF = F.gelu(hpre_ECF)
        y_ECD = torch.baddbmm(b2.unsqueeze(1), h_ECF, w2)
        ctx.save_for_backward(x_ECD, w1, w2, hpre_ECF, h_ECF, slot_N)
        ctx.grad_scale, ctx.counts = grad_scale, counts
        y_ND = y_ECD.view(-1, d)
        return y_ND if full else y_ND.index_select(0, slot_N)

    @staticmethod
    def backward(ctx, g_ND):  # type: ignore[override]
        x_ECD, w1, w2, hpre_ECF, h_ECF, slot_N = ctx.saved_tensors
        n_exp, cap, d = x_ECD.shape
        g_ND = g_ND.contiguous()
        if slot_N is None:
            g_ECD = g_ND.view(n_exp, cap, d)
        else:
            g_ECD = g_ND.new_zeros(n_exp * cap, d).index_copy_(0, slot_N, g_ND).view(n_exp, cap, d)
        gb2 = g_ECD.sum(1)
        gh_ECF = torch.ops.aten.gelu_backward(torch.bmm(g_ECD, w2.transpose(1, 2)), hpre_ECF)
        gb1 = gh_ECF.sum(1)
        # Weight gradients one expert at a time, on its real rows only: a bmm with the
        # transposed [cap, f] operand runs at about 60% of the rate of these mm calls
        # (docs/benchmarks.md), in float32 and bfloat16 alike.
        gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
        for e, n in enumerate(ctx.counts):
            if n:
                torch.mm(h_ECF[e, :n].t(), g_ECD[e, :n], out=gw2[e])
                torch.mm(x_ECD[e, :n].t(), gh_ECF[e, :n], out=gw1[e])
            else:
                gw1[e].zero_()
                gw2[e].zero_()
        gx_ND = None
        if ctx.needs_input_grad[0]:
            gx_ND = torch.bmm(gh_ECF, w1.transpose(1, 2)).view(-1, d)
            if slot_N is not None:
                gx_ND = gx_ND.index_select(0, slot_N)
        if ctx.grad_scale != 1.0:
            for t in (gw1, gb1, gw2, gb2):
                t.mul_(ctx.grad_scale)
        return gx_ND, gw1, gb1, gw2, gb2, None, None


class Experts(nn.Module):
    """GELU MLPs ``y = gelu(x @ w1[e] + b1[e]) @ w2[e] + b2[e]`` for the local experts.

    ``first_expert`` / ``num_local`` select which of the ``num_experts`` global experts this
    rank holds. Initialisation draws every global expert in order and keeps the local
    ones, so a model split over ep_size ranks starts with exactly the experts of the same
    model in one process (same seed), and the experts differ across ranks.

    ``grad_scale`` multiplies the weights' gradients. Expert parallelism sets it to
    1/ep_size: an expert's gradient then collects the tokens of ep_size ranks, and
    averaging it over the expert-data-parallel group (world/ep_size ranks) yields the
    same mean over all ranks that the dense parameters get from a world allreduce.

    ``kernel`` chooses how the blocks run: "loop" (one matmul per expert on exactly its
    rows), "padded" (batched matmuls over blocks padded to the largest), or "auto" (the
    default): padded when the blocks are small (at most ``pad_below_rows`` rows on
    average, where one matmul per block leaves threads idle) and padding adds at most
    ``pad_limit`` of extra rows (near-balanced routing, e.g. capacity-limited training);
    the loop otherwise. Measured (docs/benchmarks.md): padded wins at 64-128 rows per
    block, the loop at 256 and more. The padded path's memory
    is bounded by the same limit, so skewed or dropless routing never pads E x S rows.
    """

    KERNELS = ("auto", "loop", "padded")

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ffn: int,
        first_expert: int = 0,
        num_local: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        num_local = num_experts - first_expert if num_local is None else num_local
        if not 0 <= first_expert < num_experts or first_expert + num_local > num_experts:
            raise ValueError(
                f"local experts [{first_expert}, {first_expert + num_local}) are outside "
                f"the {num_experts} experts"
            )
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.num_local = num_local
        self.d_model = d_model
        self.d_ffn = d_ffn
        self.grad_scale = 1.0
        self.kernel = "auto"
        self.pad_limit = 0.25
        self.pad_below_rows = 192
        kw = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_ffn, **kw))
        self.b1 = nn.Parameter(torch.empty(num_local, d_ffn, **kw))
        self.w2 = nn.Parameter(torch.empty(num_local, d_ffn, d_model, **kw))
        self.b2 = nn.Parameter(torch.empty(num_local, d_model, **kw))
        for p in self.parameters():
            p.moebit_expert = True  # found by split_params_for_ep and grad averaging
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default init (U(+-1/sqrt(fan_in))) per expert, drawn in global order."""
        lo, hi = self.first_expert, self.first_expert + self.num_local
        for p, fan_in in ((self.w1, self.d_model), (self.b1, self.d_model),
                          (self.w2, self.d_ffn), (self.b2, self.d_ffn)):
            bound = 1.0 / math.sqrt(fan_in)
            scratch = torch.empty(p.shape[1:], dtype=p.dtype, device=p.device)
            for e in range(self.num_experts):
                if lo <= e < hi:
                    p[e - lo].uniform_(-bound, bound)
                else:
                    scratch.uniform_(-bound, bound)  # keep the RNG stream rank-independent

    def forward(self, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run expert e on rows [sum(counts[:e]), sum(counts[:e+1])) of ``x_ND``."""
        if len(counts) != self.num_local:
            raise ValueError(f"got {len(counts)} block sizes for {self.num_local} local experts")
        if sum(counts) != x_ND.shape[0]:
            raise ValueError(f"block sizes sum to {sum(counts)} but x has {x_ND.shape[0]} rows")
        w1, b1, w2, b2 = self.w1, self.b1, self.w2, self.b2
        dev = x_ND.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x_ND, w1, b1, w2, b2 = (t.to(dt) for t in (x_ND, w1, b1, w2, b2))
        elif x_ND.dtype != w1.dtype:
            x_ND = x_ND.to(w1.dtype)
        fn = _ExpertMLPPadded if self._use_padded(counts) else _ExpertMLP
        with torch.autocast(dev, enabled=False):
            return fn.apply(x_ND, w1, b1, w2, b2, list(counts), self.grad_scale)

    def _use_padded(self, counts: list[int]) -> bool:
        if self.kernel not in self.KERNELS:
            raise ValueError(f"Experts.kernel must be one of {self.KERNELS}, got {self.kernel!r}")
        if self.kernel != "auto":
            return self.kernel == "padded" and sum(counts) > 0
        rows, n = sum(counts), len(counts)
        return (rows > 0 and n > 1 and rows <= self.pad_below_rows * n
                and n * max(counts) <= (1 + self.pad_limit) * rows)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local - 1} of "
                f"{self.num_experts}, d_model={self.d_model}, d_ffn={self.d_ffn}")
