"""Which parameters DiLoCo syncs, and how they are cut: blocks, fragments, expert marks, and
the checks that refuse an inner optimizer that cannot be wrapped."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moebit.comm import collectives
from moebit.comm.quantize import DEFAULT_BLOCK
from moebit.optim.base import check_range, check_step_arg
from moebit.optim.outer_compress import COMPRESSIONS

__all__ = ["BLOCK_ALIGN", "FRAGMENT_CUTS", "Blocks", "OuterSettings", "Piece", "check_inner", "marked_expert",
           "module_blocks", "split_fragments"]

# blocks: fragments of whole consecutive blocks (the paper's layers); even: equal runs of
# elements (a fragment may end inside a matrix), so the largest is 1/F of the model.
FRAGMENT_CUTS = ("blocks", "even")
# elements: even fragments and a node's slices of an exchange end on whole blocks of the
# default int8 and 1-bit scales, so cutting an exchange does not move its scales
BLOCK_ALIGN = DEFAULT_BLOCK

@dataclass(frozen=True)
class OuterSettings:
    """The outer optimizer's settings, checked on construction: a bad one is a one-line
    ValueError naming its flat key (``outer_every``...), as a config file spells it."""

    every: int
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    compress: str = "none"
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    int8_block: int = 256
    onebit_block: int = 256  # elements per 1-bit scale; 0: one scale per chunk
    cut: str = "blocks"  # how fragments are cut: FRAGMENT_CUTS

    def __post_init__(self) -> None:
        check_step_arg("outer_every", self.every, "inner steps between outer syncs")
        check_range("outer_lr", self.lr, 0.0, lo_open=True)
        if check_range("outer_momentum", self.momentum, 0.0, 1.0) >= 1.0:
            raise ValueError(f"invalid outer_momentum {self.momentum!r}: must be below 1")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"invalid outer_nesterov {self.nesterov!r}: expected true or false")
        if self.compress not in COMPRESSIONS:
            raise ValueError(f"invalid outer_compress {self.compress!r}: expected one of "
                             f"{', '.join(COMPRESSIONS)}")
        check_step_arg("outer_fragments", self.fragments, "fragments of the model")
        if self.fragments > self.every:
            raise ValueError(f"invalid outer_fragments {self.fragments}: at most outer_every="
                             f"{self.every} (each fragment needs its own step of the interval)")
        check_step_arg("outer_delay", self.delay, "inner steps an exchange overlaps", minimum=0)
        if self.delay * self.fragments >= self.every:
            raise ValueError(
                f"invalid outer_delay {self.delay}: must be below outer_every/outer_fragments = "
                f"{self.every}/{self.fragments}, so that one fragment's exchange ends before the "
                "next starts")
        if check_range("outer_alpha", self.alpha, 0.0, 1.0) >= 1.0:
            raise ValueError(f"invalid outer_alpha {self.alpha!r}: must be below 1 (1 never "
                             "applies the outer update)")
        check_step_arg("outer_int8_block", self.int8_block, "elements per int8 scale")
        ob = self.onebit_block
        if isinstance(ob, bool) or not isinstance(ob, int) or ob < 0 or ob % 8:
            raise ValueError(f"invalid outer_onebit_block {ob!r}: elements per 1-bit scale, "
                             f"a multiple of 8, or 0 for one scale per chunk")
        if self.cut not in FRAGMENT_CUTS:
            raise ValueError(f"invalid outer_fragment_cut {self.cut!r}: expected one of "
                             f"{', '.join(FRAGMENT_CUTS)}")


Blocks = Iterable[torch.Tensor] | Iterable[Iterable[torch.Tensor] | nn.Module]


def module_blocks(blocks: Blocks) -> list[list[torch.Tensor]]:
    """Blocks as lists of trainable parameters, each parameter in the first block holding it.

    ``blocks`` is a flat iterable of parameters (each one its own block) or an iterable of
    blocks, each an ``nn.Module`` or an iterable of parameters: for a transformer, the
    embedding, then each layer, then the final norm and head. Tied parameters appear once.
    """
    seen: set[int] = set()
    out: list[list[torch.Tensor]] = []
    for b in blocks:
        items = [b] if isinstance(b, torch.Tensor) else list(
            b.parameters() if isinstance(b, nn.Module) else b)
        block = []
        for p in items:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"outer optimizer blocks hold tensors, got {type(p).__name__}")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                block.append(p)
        if block:
            out.append(block)
    return out


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of one parameter, counted in the flat tensor this rank holds (its
    local shard under FSDP2): a fragment is a list of pieces."""

    param: torch.Tensor
    lo: int
    hi: int


def split_fragments(blocks: list[list[torch.Tensor]], fragments: int, cut: str = "blocks",
                    held: Callable[[torch.Tensor], torch.Tensor] = lambda p: p,
                    ) -> list[list[Piece]]:
    """``fragments`` non-empty fragments, in block order.

    ``cut="blocks"``: groups of consecutive whole blocks whose largest holds as few elements
    as possible (a sync's peak traffic is its largest fragment; balanced by the parameters'
    global sizes, so every rank of a sharded node syncs the same blocks at the same step).
    ``cut="even"``: the parameters' held elements (``held(p)``: the local shard) end to end,
    cut into equal runs on multiples of ``BLOCK_ALIGN``: the largest fragment is 1/F of the
    model, whatever its blocks.
    """
    if cut == "even":
        return even_fragments([p for b in blocks for p in b], fragments, held)
    if fragments > len(blocks):
        raise ValueError(f"invalid outer_fragments {fragments}: more fragments than the "
                         f"{len(blocks)} blocks of trainable parameters")
    bounds = balanced_bounds([sum(p.numel() for p in b) for b in blocks], fragments)
    return [[Piece(p, 0, held(p).numel()) for b in blocks[lo:hi] for p in b]
            for lo, hi in zip(bounds, bounds[1:], strict=False)]


def even_fragments(params: list[torch.Tensor], fragments: int,
                   held: Callable[[torch.Tensor], torch.Tensor]) -> list[list[Piece]]:
    """The ``cut="even"`` fragments of ``split_fragments``."""
    sizes = [held(p).numel() for p in params]
    total = sum(sizes)
    bounds = [min(total, round(i * total / fragments / BLOCK_ALIGN) * BLOCK_ALIGN)
              for i in range(fragments)] + [total]
    if any(hi <= lo for lo, hi in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"invalid outer_fragments {fragments}: {total} elements cannot make "
                         f"{fragments} fragments of whole runs of {BLOCK_ALIGN}")
    out: list[list[Piece]] = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        frag, start = [], 0
        for p, n in zip(params, sizes, strict=True):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                frag.append(Piece(p, a - start, b - start))
            start += n
        out.append(frag)
    return out


def balanced_bounds(sizes: list[int], parts: int) -> list[int]:
    """Cut points 0 = b_0 < ... < b_parts = len(sizes) minimizing the largest part's sum
    (dynamic programming over prefix sums; the first minimum wins, so it is deterministic)."""
    n = len(sizes)
    pre = [0]
    for s in sizes:
        pre.append(pre[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i blocks in k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], pre[i] - pre[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]



def marked_expert(p: torch.Tensor) -> bool:
    """moebit.moe's mark on expert weights (this layer cannot import moe)."""
    return bool(getattr(p, "moebit_expert", False))


def check_inner(inner: Any, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Refuse what cannot be wrapped: not an optimizer, parameters it does not train (or
    trains but no fragment syncs), and inner groups that average across the outer group."""
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"outer optimizer: the inner optimizer must be a torch.optim.Optimizer "
                        f"(AdamW, OnebitAdam, ZeroOneAdam, OnebitLamb), got {type(inner).__name__}")
    trained = {id(p) for g in inner.param_groups for p in g["params"] if p.requires_grad}
    synced = {id(p) for p in params}
    if synced - trained:
        raise ValueError(f"outer optimizer: {len(synced - trained)} parameter(s) of the blocks "
                         "are not trained by the inner optimizer")
    if trained - synced:
        raise ValueError(f"outer optimizer: the inner optimizer trains {len(trained - synced)} "
                         "parameter(s) that no block holds; their replicas would never sync")
    if not dist.is_initialized() or collectives.world_size() == 1:
        return
    me = dist.get_rank()
    outer = set(dist.get_process_group_ranks(group)) if group is not None else set(
        range(dist.get_world_size()))
    default = getattr(inner, "_default_pg", None)
    for gi, g in enumerate(inner.param_groups):
        pg = g.get("process_group", default)
        ranks = set(dist.get_process_group_ranks(pg)) if pg is not None else set(
            range(dist.get_world_size()))
        shared = sorted((ranks & outer) - {me})
        if shared:
            raise ValueError(
                f"outer optimizer: inner param group {gi} averages over ranks {sorted(ranks)}, "
                f"which include ranks {shared} of the outer group: give it the inner group "
                "as process_group (moebit.comm.outer_groups.inner_param_groups)")

