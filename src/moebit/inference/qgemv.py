"""Weight-only int8 / int4 matrix products for decoding: few activation rows, packed weights.

    qw = quantize_weight(w_NK, bits=4, group=64)   # w as nn.Linear stores it: [out, in]
    y_RN = qgemm(x_RK, qw)                         # float32, about x @ w.T

Why: a decode step multiplies 1-16 rows by every weight it touches, so its time is the
weight bytes read divided by memory bandwidth. int8 reads 4x fewer bytes than float32 and
int4 8x; the native kernels (``moebit.inference._qgemv_c``) dequantize in registers, so
the bytes read are the packed ones. Inference only: nothing here records autograd.

Quantization is symmetric with one float32 scale per ``group`` consecutive weights along
K (the input dimension) of each output row: s = max|w| / qmax with qmax 127 (int8) or 7
(int4), q = round(w / s), so |w - q * s| <= s / 2 for every weight. ``group=0`` means one
group per row (per output channel; int8 only, no padding): the layout of
``torch._weight_int8pack_mm``, so both kernels can serve the same weights. Smaller groups
bound the error by the local rather than the row's largest weight, at 4 bytes per group.

``qgemm`` runs the native kernel for the CPU's ISA level (``isa`` picks another one the
CPU can run, for tests); ``qgemm_reference`` is the same product by dequantizing in torch,
the fallback where the native build is unavailable and the reference the tests hold the
kernels to.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from moebit.inference import _qgemv_c

BITS = (8, 4)
_QMAX = {8: 127, 4: 7}


@dataclass(frozen=True)
class QWeight:
    """Packed weights: ``q`` int8 [..., N, Kp] (bits 8) or uint8 [..., N, Kp // 2] (bits 4;
    see ``_qgemv_c`` for the nibble order), ``s`` float32 [..., N, Kp // group]; ``k`` the
    real input size (K <= Kp, the padding is zeros). Leading dims stack experts:
    ``qw[e]`` is expert e's weight."""

    q: torch.Tensor
    s: torch.Tensor
    bits: int
    k: int
    group: int

    @property
    def n(self) -> int:
        return self.q.shape[-2]

    @property
    def kp(self) -> int:
        return self.q.shape[-1] * (2 if self.bits == 4 else 1)

    def __getitem__(self, i: int) -> QWeight:
        return QWeight(self.q[i], self.s[i], self.bits, self.k, self.group)

    def nbytes(self) -> int:
        """Bytes a product reads: packed weights and scales."""
        return self.q.numel() * self.q.element_size() + self.s.numel() * 4


def _layout(k: int, bits: int, group: int) -> tuple[int, int]:
    """(Kp, group) for K inputs: K padded to whole groups (int4: of 32-multiples)."""
    if bits not in BITS:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if group < 0 or (group and bits == 4 and group % 32):
        raise ValueError(f"group must be 0 (per channel) or a positive multiple of 32 for "
                         f"int4, got {group}")
    if group == 0:
        if bits == 4:
            kp = 32 * math.ceil(k / 32)
            return kp, kp
        return k, k
    kp = group * math.ceil(k / group)
    return kp, group


def quantize_weight(w_NK: torch.Tensor, bits: int = 8, group: int = 64) -> QWeight:
    """[..., N, K] float weights (nn.Linear layout) -> ``QWeight`` (symmetric, per group)."""
    if w_NK.dim() < 2 or not w_NK.is_floating_point():
        raise ValueError(f"quantize_weight: w must be a float [..., N, K] tensor, got "
                         f"{w_NK.dtype} {tuple(w_NK.shape)}")
    *lead, n, k = w_NK.shape
    kp, g = _layout(k, bits, group)
    w = w_NK.detach().float()
    if kp != k:
        w = torch.nn.functional.pad(w, (0, kp - k))
    wg = w.reshape(*lead, n, kp // g, g)
    qmax = _QMAX[bits]
    s = wg.abs().amax(-1) / qmax
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(wg / safe[..., None]).clamp_(-qmax, qmax).reshape(*lead, n, kp)
    if bits == 8:
        packed = q.to(torch.int8)
    else:
        u = (q + 8).to(torch.uint8).reshape(*lead, n, kp // 32, 2, 16)
        packed = (u[..., 0, :] | (u[..., 1, :] << 4)).reshape(*lead, n, kp // 2)
    return QWeight(packed.contiguous(), s.contiguous(), bits, k, g)


def dequantize_weight(qw: QWeight) -> torch.Tensor:
    """The float32 [..., N, K] weights ``qw`` stands for."""
    if qw.bits == 8:
        q = qw.q.float()
    else:
        b = qw.q.reshape(*qw.q.shape[:-1], -1, 16)
        lo, hi = (b & 15).float() - 8, (b >> 4).float() - 8
        q = torch.stack([lo, hi], -2).reshape(*qw.q.shape[:-1], qw.kp)
    g = q.reshape(*q.shape[:-1], qw.kp // qw.group, qw.group) * qw.s[..., None]
    return g.reshape(*q.shape[:-1], qw.kp)[..., : qw.k]


def qgemm_reference(x_RK: torch.Tensor, qw: QWeight) -> torch.Tensor:
    """x @ dequant(qw).T in float32 through torch: the fallback and the tests' reference."""
    return x_RK.float() @ dequantize_weight(qw).t()


def native_available(isa: str | None = None) -> bool:
    """Whether the native kernels build and load here (for ``isa``, default the best)."""
    return _qgemv_c.load(isa) is not None


_warned = False


def _fallback_warning() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("moebit: native int8/int4 GEMV unavailable; quantized products "
                      "dequantize in torch instead (slower)", RuntimeWarning, stacklevel=3)


def qgemm(x_RK: torch.Tensor, qw: QWeight, isa: str | None = None,
          threads: int | None = None) -> torch.Tensor:
    """float32 [R, N] = x [R, K] @ dequant(qw).T on the native kernel; without one, the
    torch reference (warns once). ``threads``: default ``torch.get_num_threads()``."""
    if x_RK.dim() != 2 or x_RK.shape[1] != qw.k:
        raise ValueError(f"qgemm: x must be [R, {qw.k}], got {tuple(x_RK.shape)}")
    if qw.q.dim() != 2:
        raise ValueError(f"qgemm: one weight at a time (index experts first), got q "
                         f"{tuple(qw.q.shape)}")
    lib = _qgemv_c.load(isa) if x_RK.device.type == "cpu" else None
    if lib is None:
        if x_RK.device.type == "cpu":
            _fallback_warning()
        return qgemm_reference(x_RK, qw)
    x = x_RK.float()
    if qw.kp != qw.k:
        x = torch.nn.functional.pad(x, (0, qw.kp - qw.k))
    x = x.contiguous()
    q, s = qw.q.contiguous(), qw.s.contiguous()
    if s.dtype != torch.float32:
        s = s.float()  # model.to(dtype) may have cast the scales
    r = x.shape[0]
    y = torch.empty(r, qw.n, dtype=torch.float32)
    if r and qw.n:
        lib.qg_gemm(qw.bits, q.data_ptr(), s.data_ptr(), x.data_ptr(), r, qw.n, qw.kp,
                    qw.group, y.data_ptr(),
                    torch.get_num_threads() if threads is None else threads)
    return y
