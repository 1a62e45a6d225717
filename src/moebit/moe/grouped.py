"""The "grouped" expert kernel: ``torch.nn.functional.grouped_mm`` for every expert type.

One grouped GEMM per projection runs all experts on their jagged row blocks (``offs`` are
the cumulative block ends), in the forward and in the backward (input gradients as 2D x 3D
products, weight gradients as 2D x 2D products over the shared row dimension). The
backward is our own (``_GroupedExperts``): torch's autograd formula for grouped_mm fails on
CPU with an expanded output gradient (torch 2.13: "Invalid strides/sizes"), and our own
node writes weight gradients in the parameters' storage layout, scales them and handles
biases the same way as the other kernels.

Alignment: the kernels want every non-unit stride a multiple of 16 bytes and 16-byte
aligned data. Widths that break it (a d or f not a multiple of 4 in float32, 8 in bf16)
are padded with zeros in the inner dimension (zero columns add nothing to a product) and
the result is cut back; aligned shapes (the usual ones) copy nothing. Empty groups are
allowed; a call with no rows at all never comes here (``Experts`` runs it on the loop,
which only allocates empty outputs).

``grouped_mm_supported(device, dtype)`` answers from a tiny real call checked against
``mm`` (cached per device and dtype): CPU builds of torch 2.13 run float32 and bfloat16;
CUDA needs sm80+ (and, per torch's documentation, bfloat16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebit.moe.kernels import _down, _scale_, _up, act_backward, act_new, is_gated

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_SUPPORTED: dict[tuple[str, int | None, torch.dtype], bool] = {}


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs (and is right) on this device and dtype in this build."""
    device = torch.device(device)
    key = (device.type, device.index, dtype)
    if key not in _SUPPORTED:
        _SUPPORTED[key] = _probe(device, dtype)
    return _SUPPORTED[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    if _GROUPED_MM is None:
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(2, 16, 8, generator=g).to(device=device, dtype=dtype)
    offs = torch.tensor([5, 12], dtype=torch.int32, device=device)
    try:
        with torch.no_grad():
            y = _GROUPED_MM(x, w, offs=offs)
            gw = _GROUPED_MM(x.t(), y, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    want = torch.cat([x[:5] @ w[0], x[5:] @ w[1]])
    want_gw = torch.stack([x[:5].t() @ want[:5], x[5:].t() @ want[5:]])
    tol = {"atol": 0.1, "rtol": 0.05}
    return bool(torch.allclose(y.float(), want.float(), **tol)
                and torch.allclose(gw.float(), want_gw.float(), **tol))


def _unit(t: torch.Tensor) -> int:
    return max(1, 16 // t.element_size())


def _ready(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose data start is 16-byte aligned (views into odd offsets get copied)."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def gmm(a_NK: torch.Tensor, b_EKM: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[N, M]: rows of group e times b[e]; ``b`` may be a transposed view."""
    u = _unit(a_NK)
    k, m = b_EKM.shape[1], b_EKM.shape[2]
    pk, pm = -k % u, -m % u
    if pk or pm:
        a_NK = F.pad(a_NK, (0, pk))
        b_EKM = F.pad(b_EKM, (0, pm, 0, pk))
        return _GROUPED_MM(a_NK, b_EKM, offs=offs)[:, :m].contiguous()
    return _GROUPED_MM(_ready(a_NK), _ready(b_EKM), offs=offs)


def gmm_wgrad(a_NK: torch.Tensor, b_NM: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[E, K, M]: a[rows of e]^T @ b[rows of e] for every group e (zeros for empty ones)."""
    u = _unit(a_NK)
    k, m = a_NK.shape[1], b_NM.shape[1]
    pk, pm = -k % u, -m % u
    if pk or pm:
        a_NK, b_NM = F.pad(a_NK, (0, pk)), F.pad(b_NM, (0, pm))
        return _GROUPED_MM(a_NK.t(), b_NM, offs=offs)[:, :k, :m].contiguous()
    return _GROUPED_MM(_ready(a_NK).t(), _ready(b_NM), offs=offs)


def _wgrad(inp: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, kind: str) -> torch.Tensor:
    """Weight gradient of ``inp @ W[e]`` per group, in W's storage layout."""
    return gmm_wgrad(grad, inp, offs) if is_gated(kind) else gmm_wgrad(inp, grad, offs)


def _group_sums(t_NM: torch.Tensor, expert_N: torch.Tensor, n_exp: int) -> torch.Tensor:
    return t_NM.new_zeros(n_exp, t_NM.shape[1]).index_add_(0, expert_N, t_NM)


class _GroupedExperts(torch.autograd.Function):
    """All local experts with one grouped GEMM per projection, forward and backward."""

    @staticmethod
    def forward(ctx, x_ND, w_up, b_up, w_down, b_down, counts, grad_scale, kind):  # type: ignore[override]
        dev = x_ND.device
        n_t = torch.tensor(counts, device=dev)
        offs = torch.cumsum(n_t, 0).to(torch.int32)
        expert_N = None
        if b_up is not None:
            expert_N = torch.repeat_interleave(torch.arange(len(counts), device=dev), n_t)
        up, down = _up(w_up, kind), _down(w_down, kind)
        hpre_NF = gmm(x_ND, up, offs)
        if b_up is not None:
            hpre_NF.add_(b_up.index_select(0, expert_N))
        h_NF, s_NF = act_new(kind, hpre_NF)
        y_ND = gmm(h_NF, down, offs)
        if b_down is not None:
            y_ND.add_(b_down.index_select(0, expert_N))
        ctx.save_for_backward(x_ND, w_up, w_down, hpre_NF, h_NF, s_NF, offs, expert_N)
        ctx.counts, ctx.grad_scale, ctx.kind = counts, grad_scale, kind
        return y_ND

    @staticmethod
    def backward(ctx, g_ND):  # type: ignore[override]
        x_ND, w_up, w_down, hpre_NF, h_NF, s_NF, offs, expert_N = ctx.saved_tensors
        kind, n_exp = ctx.kind, len(ctx.counts)
        up, down = _up(w_up, kind), _down(w_down, kind)
        g_ND = g_ND.contiguous()
        gh_NF = act_backward(kind, gmm(g_ND, down.transpose(1, 2), offs), hpre_NF, s_NF)
        gw_down = _wgrad(h_NF, g_ND, offs, kind)
        gw_up = _wgrad(x_ND, gh_NF, offs, kind)
        for e, n in enumerate(ctx.counts):
            if not n:  # the kernels may leave empty groups' outputs unwritten
                gw_up[e].zero_()
                gw_down[e].zero_()
        gb_up = gb_down = None
        if expert_N is not None:
            gb_up = _group_sums(gh_NF, expert_N, n_exp)
            gb_down = _group_sums(g_ND, expert_N, n_exp)
        gx_ND = gmm(gh_NF, up.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
        _scale_(ctx.grad_scale, gw_up, gb_up, gw_down, gb_down)
        return gx_ND, gw_up, gb_up, gw_down, gb_down, None, None, None
