"""The expert kernels "loop" and "padded": hand-written autograd nodes for every expert type.

An expert is an up projection, an activation and a down projection:

- ``gelu_mlp``: ``gelu(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``; weights stored [E, in, out]
  (``w1`` [E, d, f], ``w2`` [E, f, d]); the biases are optional.
- ``swiglu`` / ``geglu``: ``(act(x @ Wg[e]^T) * (x @ Wu[e]^T)) @ Wd[e]^T`` with act SiLU or
  GELU (or gpt-oss's clamped SwiGLU, ``moebit.moe.glu``), optional biases on both
  projections (gpt-oss); weights stored [E, out, in] as Hugging Face 5.x does (``gate_up_proj``
  [E, 2f, d], gate rows first, and ``down_proj`` [E, d, f]).

Both layouts run through the same code: ``_up`` / ``_down`` give [E, in, out] views (a
transposed view costs nothing: the matmul library reads either order), and weight gradients
are written straight into the parameter's own layout (``_wgrad_into``), never transposed
and copied afterwards.

``_LoopExperts`` runs one matmul per expert on exactly its contiguous rows.
``_PaddedExperts`` pads every block to the largest and runs the forward and input-gradient
products as batched matmuls, which the matmul library splits across threads by expert;
that wins when blocks are small and nearly equal (measurements in ``moebit.moe.experts``).
Its weight gradients still go expert by expert on the real rows: a bmm whose first operand
is the transposed [cap, f] activation runs at about 60% of the rate of per-expert mm calls
(E=64 experts of 128 rows, d 512, f 2048, 2 threads: 206 against 130 ms in float32, 78
against 47 ms in bfloat16).

Written by hand rather than as a loop of autograd ops because each weight gradient goes
straight into its slot of one [E_local, ...] tensor: through autograd the per-expert pieces
would be stacked afterwards (an extra copy of every expert weight per step, about 0.5 GB
at E=64, d=512, f=2048). The pre-activation and activation outputs are saved (recomputing
the GELU backward would save memory but costs about 5% time); gated types also keep
``act(gate)`` (as an autograd graph of the same ops would).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moebit.moe.glu import ClampedSwiGLU, glu_backward_into, glu_into

EXPERT_TYPES = ("gelu_mlp", "swiglu", "geglu")
# ``kind`` below: an expert type, or the ClampedSwiGLU activation (a gated type)


def is_gated(kind: str) -> bool:
    return kind != "gelu_mlp"


def _up(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The up (or gate_up) weight as [E, d, F']: the stored tensor or its transposed view."""
    return w.transpose(-2, -1) if is_gated(kind) else w


_down = _up  # the same layout rule: [E, F, d]


def _wgrad_into(out: torch.Tensor, inp: torch.Tensor, grad: torch.Tensor, kind: str) -> None:
    """out = the weight gradient of ``inp @ W`` for output gradient ``grad``, in W's storage."""
    if is_gated(kind):
        torch.mm(grad.t(), inp, out=out)  # stored [out, in]
    else:
        torch.mm(inp.t(), grad, out=out)  # stored [in, out]


def act_into(kind: str, hpre: torch.Tensor, h: torch.Tensor, s: torch.Tensor | None) -> None:
    """h = the activation of ``hpre`` (gated: act(gate) * up, with act(gate) kept in s)."""
    if not is_gated(kind):
        F.gelu(hpre, out=h)  # F.gelu is the aten op: takes out=
        return
    i = h.shape[-1]
    a, u = hpre[..., :i], hpre[..., i:]
    if isinstance(kind, ClampedSwiGLU):
        glu_into(kind, a, u, h, s)
        return
    if kind == "swiglu":
        torch.ops.aten.silu.out(a, out=s)
    else:
        F.gelu(a, out=s)
    torch.mul(s, u, out=h)


def act_new(kind: str, hpre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h, s) for a whole pre-activation tensor, freshly allocated."""
    if not is_gated(kind):
        h = torch.empty_like(hpre)
        act_into(kind, hpre, h, None)
        return h, None
    shape = (*hpre.shape[:-1], hpre.shape[-1] // 2)
    h, s = hpre.new_empty(shape), hpre.new_empty(shape)
    act_into(kind, hpre, h, s)
    return h, s


def act_backward(
    kind: str, gh: torch.Tensor, hpre: torch.Tensor, s: torch.Tensor | None
) -> torch.Tensor:
    """Gradient w.r.t. the pre-activation (gated: [gate grad | up grad], like hpre)."""
    if not is_gated(kind):
        return torch.ops.aten.gelu_backward(gh, hpre)
    i = gh.shape[-1]
    a, u = hpre[..., :i], hpre[..., i:]
    g = torch.empty_like(hpre)
    if isinstance(kind, ClampedSwiGLU):
        glu_backward_into(kind, gh, a, u, s, g[..., :i], g[..., i:])
        return g
    torch.mul(gh, s, out=g[..., i:])
    gs = gh * u
    if kind == "swiglu":
        torch.ops.aten.silu_backward.grad_input(gs, a, grad_input=g[..., :i])
    else:
        torch.ops.aten.gelu_backward.grad_input(gs, a, grad_input=g[..., :i])
    return g


def _matmul_into(out, x, w, b) -> None:  # out = x @ w (+ b)
    if b is None:
        torch.mm(x, w, out=out)
    else:
        torch.addmm(b, x, w, out=out)


def _bias_grads(w_up, w_down, has_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not has_bias:
        return None, None
    return w_up.new_empty(w_up.shape[0], w_up.shape[2]), w_down.new_empty(w_down.shape[0],
                                                                         w_down.shape[2])


def _scale_(grad_scale: float, *ts: torch.Tensor | None) -> None:
    if grad_scale != 1.0:
        for t in ts:
            if t is not None:
                t.mul_(grad_scale)


def loop_buffers(x_ND, up, down, kind):
    """(out, hpre, h, s) for the loop kernels: outputs and what backward needs."""
    n_rows, d = x_ND.shape
    out_ND = x_ND.new_empty(n_rows, d)
    hpre_NF = x_ND.new_empty(n_rows, up.shape[2])
    h_NF = x_ND.new_empty(n_rows, down.shape[1])
    s_NF = torch.empty_like(h_NF) if is_gated(kind) else None
    return out_ND, hpre_NF, h_NF, s_NF


def expert_forward(e, r, x_ND, up, b_up, down, b_down, kind, out_ND, hpre_NF, h_NF, s_NF) -> None:
    """Expert e on rows ``r``: writes its slices of out, hpre, h (and s)."""
    _matmul_into(hpre_NF[r], x_ND[r], up[e], None if b_up is None else b_up[e])
    act_into(kind, hpre_NF[r], h_NF[r], None if s_NF is None else s_NF[r])
    _matmul_into(out_ND[r], h_NF[r], down[e], None if b_down is None else b_down[e])


def expert_backward(e, r, saved, g_ND, grads, kind) -> None:
    """Expert e's share of backward: its weight gradients, and its rows of gx (if wanted).

    ``saved`` = (x, up, down, hpre, h, s), ``grads`` = (gx or None, gw_up, gb_up, gw_down,
    gb_down), every one written only at expert e's slot or rows ``r`` (so experts can run
    concurrently). An expert without rows (``r`` empty) gets zero gradients.
    """
    x_ND, up, down, hpre_NF, h_NF, s_NF = saved
    gx_ND, gw_up, gb_up, gw_down, gb_down = grads
    if r.start == r.stop:
        for t in (gw_up, gw_down, gb_up, gb_down):
            if t is not None:
                t[e].zero_()
        return
    g_nD = g_ND[r]
    _wgrad_into(gw_down[e], h_NF[r], g_nD, kind)
    if gb_down is not None:
        torch.sum(g_nD, 0, out=gb_down[e])
    gh_nF = act_backward(kind, torch.mm(g_nD, down[e].t()), hpre_NF[r],
                         None if s_NF is None else s_NF[r])
    _wgrad_into(gw_up[e], x_ND[r], gh_nF, kind)
    if gb_up is not None:
        torch.sum(gh_nF, 0, out=gb_up[e])
    if gx_ND is not None:
        torch.mm(gh_nF, up[e].t(), out=gx_ND[r])


def row_slices(counts: list[int]) -> list[slice]:
    """Expert e's rows [sum(counts[:e]), sum(counts[:e+1])) as slices."""
    out, start = [], 0
    for n in counts:
        out.append(slice(start, start + n))
        start += n
    return out


def backward_grads(ctx, x_ND, up, down, w_up, w_down):
    """Empty (gx or None, gw_up, gb_up, gw_down, gb_down) for a loop kernel's backward."""
    gx_ND = torch.empty_like(x_ND) if ctx.needs_input_grad[0] else None
    gb_up, gb_down = _bias_grads(up, down, ctx.has_bias)
    return gx_ND, torch.empty_like(w_up), gb_up, torch.empty_like(w_down), gb_down


def run_in_order(counts: list[int], job: Callable[[int, slice], None]) -> None:
    """``job(e, rows)`` for every local expert, one after another."""
    for e, r in enumerate(row_slices(counts)):
        job(e, r)


Runner = Callable[[list[int], Callable[[int, slice], None]], None]


def loop_forward(ctx, run: Runner, x_ND, w_up, b_up, w_down, b_down, counts, grad_scale, kind):
    """The loop kernels' forward: each expert on its row block, in the order ``run`` gives."""
    up, down = _up(w_up, kind), _down(w_down, kind)
    bufs = loop_buffers(x_ND, up, down, kind)

    def job(e: int, r: slice) -> None:
        if r.start != r.stop:
            expert_forward(e, r, x_ND, up, b_up, down, b_down, kind, *bufs)

    run(counts, job)
    ctx.save_for_backward(x_ND, w_up, w_down, *bufs[1:])
    ctx.counts, ctx.grad_scale, ctx.kind, ctx.has_bias = counts, grad_scale, kind, b_up is not None
    return bufs[0]


def loop_backward(ctx, run: Runner, g_ND):
    """The loop kernels' backward: each expert's input and weight gradients into its slots."""
    x_ND, w_up, w_down, hpre_NF, h_NF, s_NF = ctx.saved_tensors
    kind = ctx.kind
    up, down = _up(w_up, kind), _down(w_down, kind)
    g_ND = g_ND.contiguous()
    grads = backward_grads(ctx, x_ND, up, down, w_up, w_down)
    saved = (x_ND, up, down, hpre_NF, h_NF, s_NF)
    run(ctx.counts, lambda e, r: expert_backward(e, r, saved, g_ND, grads, kind))
    gx_ND, gw_up, gb_up, gw_down, gb_down = grads
    _scale_(ctx.grad_scale, gw_up, gb_up, gw_down, gb_down)
    return gx_ND, gw_up, gb_up, gw_down, gb_down, None, None, None


class _LoopExperts(torch.autograd.Function):
    """Every local expert on its contiguous row block, one matmul per projection and expert."""

    @staticmethod
    def forward(ctx, x_ND, w_up, b_up, w_down, b_down, counts, grad_scale, kind):  # type: ignore[override]
        return loop_forward(ctx, run_in_order, x_ND, w_up, b_up, w_down, b_down, counts,
                            grad_scale, kind)

    @staticmethod
    def backward(ctx, g_ND):  # type: ignore[override]
        return loop_backward(ctx, run_in_order, g_ND)


def _padded_slots(counts: list[int], cap: int, device: torch.device) -> torch.Tensor:
    """Row of each sorted pair in an [E_local * cap] buffer: expert e's block starts at e * cap."""
    n = torch.tensor(counts, device=device)
    starts = torch.cumsum(n, 0) - n
    expert_N = torch.repeat_interleave(torch.arange(len(counts), device=device), n)
    return expert_N * cap + torch.arange(int(n.sum()), device=device) - starts[expert_N]


def _bmm(x, w, b) -> torch.Tensor:  # x @ w (+ b), batched over experts
    return torch.bmm(x, w) if b is None else torch.baddbmm(b.unsqueeze(1), x, w)


def _to_blocks(t_ND: torch.Tensor, slot_N: torch.Tensor | None, n_exp: int, cap: int):
    if slot_N is None:
        return t_ND.view(n_exp, cap, t_ND.shape[1])
    out = t_ND.new_zeros(n_exp * cap, t_ND.shape[1]).index_copy_(0, slot_N, t_ND)
    return out.view(n_exp, cap, t_ND.shape[1])


class _PaddedExperts(torch.autograd.Function):
    """The same experts as ``_LoopExperts``, as batched matmuls over blocks padded to the largest.

    Padding rows are zeros in the input and get zero output gradients, so they add nothing
    to any gradient (an activation's backward of a zero gradient is zero); they cost FLOPs
    and memory, which is why ``Experts`` picks this path only for nearly equal blocks.
    """

    @staticmethod
    def forward(ctx, x_ND, w_up, b_up, w_down, b_down, counts, grad_scale, kind):  # type: ignore[override]
        n_exp, d = len(counts), x_ND.shape[1]
        cap = max(counts)
        full = all(c == cap for c in counts)
        slot_N = None if full else _padded_slots(counts, cap, x_ND.device)
        x_ECD = _to_blocks(x_ND, slot_N, n_exp, cap)
        hpre_ECF = _bmm(x_ECD, _up(w_up, kind), b_up)
        h_ECF, s_ECF = act_new(kind, hpre_ECF)
        y_ECD = _bmm(h_ECF, _down(w_down, kind), b_down)
        ctx.save_for_backward(x_ECD, w_up, w_down, hpre_ECF, h_ECF, s_ECF, slot_N)
        ctx.counts, ctx.grad_scale, ctx.kind, ctx.has_bias = counts, grad_scale, kind, b_up is not None
        y_ND = y_ECD.view(-1, d)
        return y_ND if full else y_ND.index_select(0, slot_N)

    @staticmethod
    def backward(ctx, g_ND):  # type: ignore[override]
        x_ECD, w_up, w_down, hpre_ECF, h_ECF, s_ECF, slot_N = ctx.saved_tensors
        kind = ctx.kind
        up, down = _up(w_up, kind), _down(w_down, kind)
        n_exp, cap, d = x_ECD.shape
        g_ECD = _to_blocks(g_ND.contiguous(), slot_N, n_exp, cap)
        gb_down = g_ECD.sum(1) if ctx.has_bias else None
        gh_ECF = act_backward(kind, torch.bmm(g_ECD, down.transpose(1, 2)), hpre_ECF, s_ECF)
        gb_up = gh_ECF.sum(1) if ctx.has_bias else None
        # Weight gradients one expert at a time, on its real rows only (module docstring).
        gw_up, gw_down = torch.empty_like(w_up), torch.empty_like(w_down)
        for e, n in enumerate(ctx.counts):
            if n:
                _wgrad_into(gw_down[e], h_ECF[e, :n], g_ECD[e, :n], kind)
                _wgrad_into(gw_up[e], x_ECD[e, :n], gh_ECF[e, :n], kind)
            else:
                gw_up[e].zero_()
                gw_down[e].zero_()
        gx_ND = None
        if ctx.needs_input_grad[0]:
            gx_ND = torch.bmm(gh_ECF, up.transpose(1, 2)).view(-1, d)
            if slot_N is not None:
                gx_ND = gx_ND.index_select(0, slot_N)
        _scale_(ctx.grad_scale, gw_up, gb_up, gw_down, gb_down)
        return gx_ND, gw_up, gb_up, gw_down, gb_down, None, None, None
