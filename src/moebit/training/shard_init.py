"""``--init-from HF_DIR`` under ``shard``: each rank reads from the safetensors only the
rows of each tensor it keeps.

The model is built without initialising its weights (``build_empty``), sharded, and
every parameter's local shard (FSDP shards dim 0: rows ``[offset, offset + n)`` of the
global tensor) is filled from a ``get_slice`` of its tensor; stacked experts are rows
too, so a rank opens only its experts' tensors (per-expert layout) or reads only their
rows (fused layout). A rank whose shard of a tensor is empty reads nothing of it. The
routers' fixed selection biases are buffers, replicated: every rank reads them whole.

A family without safetensors folders (moebit's GPT) loads whole and is then sharded
(``moebit.training.setup.build_run_model``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moebit.models.hf.weights import (
    _DEFAULT_PER_EXPERT,
    _PER_EXPERT,
    HFFolderError,
    SafetensorsFolder,
    _bias_targets,
    _moe_prefix,
    hf_name,
)


@dataclass
class SliceReport:
    """What one rank read: (tensor, first row, rows) per read, and the bytes."""

    reads: list[tuple[str, int, int]] = field(default_factory=list)
    bytes_read: int = 0


def local_rows(p: torch.Tensor) -> tuple[int, int]:
    """(first global row, rows) of dim 0 this rank keeps of ``p``; a plain tensor is
    kept whole."""
    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0], shape[0]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class _Reader:
    def __init__(self, folder: Path) -> None:
        self.src = SafetensorsFolder(folder)
        self.report = SliceReport()

    def into(self, name: str, first: int, n: int, dst: torch.Tensor) -> None:
        """Rows ``[first, first + n)`` of tensor ``name`` into ``dst`` (nothing for n=0)."""
        if n == 0:
            return
        t = self.src.read(name, slice(first, first + n))
        if tuple(t.shape) != tuple(dst.shape):
            raise HFFolderError(f"{self.src.folder / self.src.where[name]}: tensor {name}"
                                f"[{first}:{first + n}] has shape {tuple(t.shape)}, this "
                                f"rank's shard of it is {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(t)
        self.report.reads.append((name, first, n))
        self.report.bytes_read += t.numel() * t.element_size()


def _dense(model: Any, r: _Reader) -> None:
    mt = model.config.model_type
    for name, p in model.named_parameters():  # a tied lm_head is listed once, as wte
        if ".mlp.experts." in name:
            continue
        hn = hf_name(name, mt)
        if hn not in r.src and ".mlp." in hn:
            hn = hn.replace(".mlp.", ".block_sparse_moe.")
        if hn not in r.src:
            raise HFFolderError(f"{r.src.folder}: no tensor {hf_name(name, mt)}")
        first, n = local_rows(p)
        r.into(hn, first, n, _local(p))


def _experts(model: Any, r: _Reader, layer: int) -> None:
    """This rank's rows of the layer's stacked experts: global experts ``lo + first ..``
    (``lo``: the ep rank's first expert)."""
    experts = model.blocks[layer].mlp.experts
    gu, down = experts.gate_up_proj, experts.down_proj
    first, n = local_rows(gu)
    lo = experts.first_expert + first
    prefix = _moe_prefix(r.src, layer)
    if f"{prefix}.experts.gate_up_proj" in r.src:  # 5.x fused: the rows of these experts
        r.into(f"{prefix}.experts.gate_up_proj", lo, n, _local(gu))
        r.into(f"{prefix}.experts.down_proj", lo, n, _local(down))
        return
    g_n, u_n, d_n = _PER_EXPERT.get(model.config.model_type, _DEFAULT_PER_EXPERT)
    f = experts.d_ffn
    for i in range(n):
        e = lo + i
        base = f"{prefix}.experts.{e}"
        gate_up = _local(gu)[i]
        for part, dst in ((g_n, gate_up[:f]), (u_n, gate_up[f:]), (d_n, _local(down)[i])):
            name = f"{base}.{part}.weight"
            if name not in r.src:
                raise HFFolderError(f"{r.src.folder}: no tensor {name}")
            r.into(name, 0, dst.shape[0], dst)


def load_hf_sharded(model: Any, folder: str | Path) -> SliceReport:
    """Fill a sharded ``HFDecoder`` (``shard_model`` applied, storage allocated) from a
    Hugging Face folder, reading only this rank's rows; returns what was read."""
    r = _Reader(Path(folder))
    _dense(model, r)
    for name, _, bias in _bias_targets(model, r.src):
        r.into(name, 0, bias.shape[0], bias)
    for layer in model.config.moe_layers:
        _experts(model, r, layer)
    return r.report
