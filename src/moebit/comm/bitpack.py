"""Signs packed 8 to a byte, and the fused decode / error-feedback steps of 1-bit allreduce.

Convention (everywhere, every path): bit k of byte j holds element 8*j+k, and it is 1 where
the element is >= 0 under IEEE comparison. So +0.0 and -0.0 both pack as +1 (they compare
equal to 0), and NaN packs as -1 (every comparison with NaN is false). The unused high bits
of a last partial byte are 0. Decoding gives +1 for a set bit, -1 for a clear one.

Why fused steps: on CPU the 1-bit allreduce is bound by memory traffic, not arithmetic.
``feedback_step_`` adds the previous compression error to the input, accumulates the
squared norm and packs the signs in one pass, so the worker reads its data once; the error
itself is kept implicitly as "last input y and its scale s" (error = y - s*sign(y)), which
saves a second pass that would subtract the scaled signs. ``server_step_`` decodes and sums
all ranks' scaled signs and does the same step on the sum.

Paths: CPU float32 tensors use the native kernels of ``_bitpack_c`` (compiled with gcc at
first use); everything else (CUDA, or CPU without a compiler, or ``MOEBIT_NATIVE=0``) uses
plain torch ops with identical results up to float summation order.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np
import torch

from moebit.comm import _bitpack_c

__all__ = [
    "pack_signs",
    "unpack_signs",
    "unpack_scaled",
    "signs_weighted_sum",
    "feedback_step_",
    "server_step_",
    "feedback_error",
    "native_available",
    "empty_fast",
]


def native_available() -> bool:
    """Whether the compiled CPU kernels are in use (False means the torch/numpy path)."""
    return _bitpack_c.load() is not None


def _native(*tensors: torch.Tensor):
    """The native library when every tensor is a contiguous CPU tensor, else None."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    return _bitpack_c.load()


_HUGE = 1 << 21
_libc: Any = None


def empty_fast(n: int, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> torch.Tensor:
    """``torch.empty(n)``, asking Linux for huge pages when it is large and on CPU.

    Why: the first write to a fresh 128 MiB tensor takes 32768 page faults, which cost
    more than the unpacking that fills it (0.5 against 5 G elements/s here). With
    ``madvise(MADV_HUGEPAGE)`` it takes 64. Where that is unavailable, a plain tensor.
    """
    global _libc
    t = torch.empty(n, dtype=dtype, device=device)
    nbytes = n * t.element_size()
    if t.device.type != "cpu" or nbytes < 4 * _HUGE or sys.platform != "linux":
        return t
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = (t.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
        end = (t.data_ptr() + nbytes) & ~(_HUGE - 1)
        _libc.madvise(start, end - start, 14)  # MADV_HUGEPAGE; failure is harmless
    except (OSError, AttributeError):
        pass
    return t


def _check_float(x: torch.Tensor, what: str) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {x.dtype}")


def _nbytes(n: int) -> int:
    return (n + 7) // 8


# ----------------------------------------------------------------------------- torch path


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def _pack_torch(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    bits = torch.zeros(_nbytes(n) * 8, dtype=torch.uint8, device=x.device)
    bits[:n] = (x.reshape(-1) >= 0).to(torch.uint8)
    # Distinct powers of two never carry, so a sum in int32 equals the bitwise or.
    w = _bit_weights(x.device).to(torch.int32)
    return (bits.view(-1, 8).to(torch.int32) * w).sum(1).to(torch.uint8)


def _signs_torch(packed: torch.Tensor, n: int) -> torch.Tensor:
    """±1 float32 tensor of the first n signs of ``packed`` (last dim; leading dims kept)."""
    w = _bit_weights(packed.device)
    bits = (packed.unsqueeze(-1) & w) != 0
    bits = bits.reshape(*packed.shape[:-1], -1)[..., :n]
    return bits.to(torch.float32) * 2 - 1


def _feedback_torch(a: torch.Tensor, y: torch.Tensor, s: float) -> torch.Tensor:
    """New compressor input: a + (y - s*sign(y)), with sign(y) = +1 where y >= 0."""
    return a + torch.where(y >= 0, y - s, y + s)


# ----------------------------------------------------------------------------- public API


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the signs of ``x`` (flattened), 8 per byte: a uint8 tensor of ceil(n/8) bytes."""
    _check_float(x, "pack_signs input")
    flat = x.reshape(-1)
    n = flat.numel()
    if x.device.type != "cpu":
        return _pack_torch(flat)
    if flat.dtype != torch.float32:
        flat = flat.float()
    flat = flat.contiguous()
    lib = _bitpack_c.load()
    if lib is None:
        return torch.from_numpy(np.packbits(flat.numpy() >= 0, bitorder="little"))
    out = torch.empty(_nbytes(n), dtype=torch.uint8)
    lib.mb_pack(flat.data_ptr(), n, out.data_ptr())
    return out


def unpack_scaled(
    packed: torch.Tensor, n: int, scale: float = 1.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The first ``n`` signs of ``packed`` times ``scale``: float32, written to ``out`` if given."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed signs must be uint8, got {packed.dtype}")
    if packed.numel() * 8 < n:
        raise ValueError(f"{packed.numel()} packed bytes hold fewer than n={n} signs")
    packed = packed.reshape(-1)
    if out is None:
        out = empty_fast(n, torch.float32, packed.device)
    elif out.dtype != torch.float32 or out.numel() != n:
        raise ValueError(f"out must be float32 with {n} elements, got {out.dtype} {out.numel()}")
    lib = _native(packed, out)
    if lib is not None:
        lib.mb_unpack_scaled(packed.data_ptr(), n, float(scale), out.data_ptr())
        return out
    out.view(-1).copy_(_signs_torch(packed, n) * scale)
    return out


def unpack_signs(
    packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first ``n`` packed signs as a tensor of +1/-1 of ``dtype`` (in ``out`` if given).

    Decoding into an existing float32 buffer runs about 3x faster than into a new tensor,
    whose pages the kernel must first fault in and zero.
    """
    if dtype == torch.float32:
        return unpack_scaled(packed, n, 1.0, out=out)
    ones = unpack_scaled(packed, n, 1.0).to(dtype)
    return ones if out is None else out.copy_(ones)


def server_step_(
    rows: torch.Tensor, scales: list[float], n: int, z: torch.Tensor, s: float, out: torch.Tensor
) -> float:
    """The server's fused decode-and-recompress step, in place.

    ``rows`` is [R, >= ceil(n/8)] uint8, one row of packed signs per rank (extra trailing
    bytes, e.g. an appended scale, are ignored). With a = sum_r scales[r] * sign_r, sets
    z <- a + (z - s*sign(z)) for the first n elements, packs sign(z) into ``out`` and returns
    sum(z**2). With z = 0 and s = 0 this is just the weighted sum of signs.
    """
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] * 8 < n:
        raise ValueError(f"rows must be [R, >= {_nbytes(n)}] uint8, got {rows.dtype} {rows.shape}")
    if len(scales) != rows.shape[0] or z.dtype != torch.float32 or z.numel() < n:
        raise ValueError("server_step_: one scale per row and a float32 z of n elements")
    lib = _native(rows, z, out)
    if lib is not None and rows.stride(1) == 1:
        sc = torch.tensor(scales, dtype=torch.float32)
        total = lib.mb_server(
            rows.data_ptr(), rows.stride(0), rows.shape[0], sc.data_ptr(), n, z.data_ptr(),
            float(s), out.data_ptr(),
        )
        if total < 0:
            raise MemoryError("server_step_: no memory for the decode tables")
        return float(total)
    sc = torch.tensor(scales, dtype=torch.float32, device=rows.device)
    a = (sc[:, None] * _signs_torch(rows[:, : _nbytes(n)], n)).sum(0)
    zn = _feedback_torch(a, z[:n], s)
    z[:n].copy_(zn)
    out[: _nbytes(n)].copy_(_pack_torch(zn))
    return float(zn.double().square().sum())


def signs_weighted_sum(rows: torch.Tensor, scales: list[float], n: int) -> torch.Tensor:
    """sum_r scales[r] * sign_r over the rows of packed signs [R, >= ceil(n/8)]: float32 [n]."""
    z = torch.zeros(n, dtype=torch.float32, device=rows.device)
    scratch = torch.empty(_nbytes(n), dtype=torch.uint8, device=rows.device)
    server_step_(rows, scales, n, z, 0.0, scratch)
    return z


def feedback_step_(x: torch.Tensor, y: torch.Tensor, s: float, out: torch.Tensor) -> float:
    """The worker's fused step, in place: y <- x + (y - s*sign(y)); pack sign(y); sum(y**2).

    ``x`` and ``y`` are float32 with the same number of elements, ``out`` uint8 with at least
    ceil(n/8) bytes. ``y - s*sign(y)`` is the error the previous compression left behind, so
    y = x and s = 0 starts without error.
    """
    n = x.numel()
    if x.dtype != torch.float32 or y.dtype != torch.float32 or y.numel() != n:
        raise ValueError("feedback_step_: x and y must be float32 tensors of equal length")
    lib = _native(x, y, out)
    if lib is not None:
        return float(lib.mb_worker(x.data_ptr(), y.data_ptr(), float(s), n, out.data_ptr()))
    yn = _feedback_torch(x.reshape(-1), y.reshape(-1), s)
    y.view(-1).copy_(yn)
    out[: _nbytes(n)].copy_(_pack_torch(yn))
    return float(yn.double().square().sum())


def feedback_error(y: torch.Tensor, s: float) -> torch.Tensor:
    """The error buffer that (y, s) stands for: y - s*sign(y), a new float32 tensor."""
    lib = _native(y)
    if lib is not None and y.dtype == torch.float32:
        err = torch.empty_like(y)
        lib.mb_error(y.data_ptr(), float(s), y.numel(), err.data_ptr())
        return err
    return torch.where(y >= 0, y - s, y + s).float()
