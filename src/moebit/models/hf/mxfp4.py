"""MXFP4 expert weights as gpt-oss checkpoints ship them: read (dequantized) and written.

The format (OCP microscaling FP4, as transformers' ``integrations/mxfp4.py`` reads it): a
weight [..., rows, K] is stored as ``*_blocks`` uint8 [..., rows, K/32, 16] and ``*_scales``
uint8 [..., rows, K/32]. Each group of 32 consecutive values along K shares one scale, a
power of two ``2 ** (scale - 127)`` (E8M0); each byte holds two FP4 (E2M1) codes, the low
nibble the even element and the high nibble the odd one; a code indexes ``FP4_VALUES``.
For gpt-oss, rows are the output features: ``gate_up_proj`` blocks [E, 2I, H/32, 16] (the
gate and up rows interleaved) and ``down_proj`` blocks [E, H, I/32, 16].

moebit dequantizes at load (into the model's dtype; FP4 times a power of two is exact in
bfloat16 and float32) and exports dequantized weights: ``quantize`` exists so that tests
can build an MXFP4 folder in the exact layout transformers reads.
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
_BIAS = 127  # E8M0 exponent bias


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., rows, G, 16] codes and [..., rows, G] scales -> [..., rows, G * 32] values."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (blocks = scales' shape + [{GROUP // 2}])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.long)
    out = torch.empty(*blocks.shape[:-1], GROUP, dtype=torch.float32)
    out[..., 0::2] = lut[b & 0x0F]
    out[..., 1::2] = lut[b >> 4]
    out = torch.ldexp(out, (scales.to(torch.int32) - _BIAS).unsqueeze(-1).float())
    return out.reshape(*blocks.shape[:-2], -1).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of ``w`` [..., K] (K a multiple of 32): per group the smallest power
    of two that brings the largest magnitude within FP4's 6, values rounded to the nearest code."""
    k = w.shape[-1]
    if k % GROUP:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {GROUP}, got {k}")
    g = w.float().reshape(*w.shape[:-1], k // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-_BIAS, _BIAS).to(torch.int32)
    scaled = g / torch.ldexp(torch.ones(()), exp.float()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # first of ties: +0
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + _BIAS).to(torch.uint8)
