"""gpt-oss expert tensors <-> moebit's experts (read by ``weights.py``, which opens the files).

transformers' ``GptOssExperts`` stores, per MoE layer, ``mlp.experts.gate_up_proj``
[E, H, 2I] (input-major, the gate and up columns interleaved: gate j at 2j, up j at 2j + 1),
``gate_up_proj_bias`` [E, 2I] (interleaved the same way), ``down_proj`` [E, I, H] and
``down_proj_bias`` [E, H]; released checkpoints ship the two weights in MXFP4 instead
(``*_blocks`` / ``*_scales``, output-major: ``moebit.models.hf.mxfp4``). moebit's experts
are [E, 2I, H] with the gate rows first and [E, H, I]: a read transposes and de-interleaves,
a write does the reverse. An expert-parallel rank reads only its rows of every tensor.

A checkpoint holds each tensor whole, so saving an expert-parallel model gathers the
experts of the expert-parallel group (``fused_expert_tensors``) and one rank writes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moebit.models.hf import mxfp4


@dataclass
class Read:
    """Tensors to read (this rank's ``rows`` of each, with the shapes the model implies),
    and what to do with them once read and checked."""

    names: tuple[str, ...]
    rows: slice
    shapes: tuple[tuple[int, ...], ...]
    assign: Callable[[list[torch.Tensor]], None]


def prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def _deinterleave_into(dst: torch.Tensor, src: torch.Tensor, f: int) -> None:
    """dst[..., :f, ...] = the even rows of src, dst[f:] the odd ones (along dim 1)."""
    with torch.no_grad():
        dst[:, :f].copy_(src[:, 0::2])
        dst[:, f:].copy_(src[:, 1::2])


def expert_reads(model: torch.nn.Module, layer: int, has: Callable[[str], bool]) -> list[Read]:
    """The reads that fill layer ``layer``'s experts, MXFP4 where the folder has blocks."""
    ex = model.blocks[layer].mlp.experts
    n, d, f = ex.num_local, ex.d_model, ex.d_ffn
    rows = slice(ex.first_expert, ex.first_expert + n)
    p = prefix(layer)
    reads = []
    if not has(f"{p}.gate_up_proj") and has(f"{p}.gate_up_proj_blocks"):
        reads.append(Read((f"{p}.gate_up_proj_blocks", f"{p}.gate_up_proj_scales"), rows,
                          ((n, 2 * f, d // 32, 16), (n, 2 * f, d // 32)),
                          lambda ts: _deinterleave_into(ex.gate_up_proj, _deq(ts, ex), f)))
    else:
        reads.append(Read((f"{p}.gate_up_proj",), rows, ((n, d, 2 * f),),
                          lambda ts: _deinterleave_into(ex.gate_up_proj, ts[0].transpose(1, 2), f)))
    reads.append(Read((f"{p}.gate_up_proj_bias",), rows, ((n, 2 * f),),
                      lambda ts: _deinterleave_into(ex.gate_up_proj_bias, ts[0], f)))
    if not has(f"{p}.down_proj") and has(f"{p}.down_proj_blocks"):
        reads.append(Read((f"{p}.down_proj_blocks", f"{p}.down_proj_scales"), rows,
                          ((n, d, f // 32, 16), (n, d, f // 32)),
                          lambda ts: _copy(ex.down_proj, _deq(ts, ex))))
    else:
        reads.append(Read((f"{p}.down_proj",), rows, ((n, f, d),),
                          lambda ts: _copy(ex.down_proj, ts[0].transpose(1, 2))))
    reads.append(Read((f"{p}.down_proj_bias",), rows, ((n, d),),
                      lambda ts: _copy(ex.down_proj_bias, ts[0])))
    return reads


def _deq(ts: list[torch.Tensor], ex: torch.nn.Module) -> torch.Tensor:
    return mxfp4.dequantize(ts[0], ts[1], ex.gate_up_proj.dtype)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src)


def _interleave(t: torch.Tensor, f: int) -> torch.Tensor:
    """The inverse of the de-interleave: rows [gate; up] -> gate j at 2j, up j at 2j + 1."""
    return torch.stack((t[:, :f], t[:, f:]), dim=2).flatten(1, 2)


def _gathered(t: torch.Tensor, groups: object) -> torch.Tensor:
    """Every rank's experts of ``t`` in expert order (ep ranks hold consecutive experts);
    ``groups``: the model's EPGroups (None: one process holds them all)."""
    if groups is None:
        return t
    group = groups.ep_group  # None there means the whole world
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, 0)


def fused_expert_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every expert of every MoE layer in transformers' gpt-oss layout. Expert parallel:
    collective over the expert-parallel group (each of its ranks must call it)."""
    group = model.ep_groups
    out = {}
    for layer in model.config.moe_layers:
        ex = model.blocks[layer].mlp.experts
        f, p = ex.d_ffn, prefix(layer)
        with torch.no_grad():
            gu = _gathered(ex.gate_up_proj.detach(), group)
            gub = _gathered(ex.gate_up_proj_bias.detach(), group)
            dn = _gathered(ex.down_proj.detach(), group)
            dnb = _gathered(ex.down_proj_bias.detach(), group)
        out[f"{p}.gate_up_proj"] = _interleave(gu, f).transpose(1, 2).contiguous()
        out[f"{p}.gate_up_proj_bias"] = _interleave(gub, f).contiguous()
        out[f"{p}.down_proj"] = dn.transpose(1, 2).contiguous()
        out[f"{p}.down_proj_bias"] = dnb.contiguous()
    return out
