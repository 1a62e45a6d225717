"""A sharded run's initial weights without the full model on any rank.

The replicated build draws every parameter from torch's CPU RNG, in the order the
constructors run (``nn.Linear``'s default init, then the family's own re-init, the
experts' per-expert draws...). A sharded run must start from exactly those values, but
no rank may hold the whole model. So the model is built on the meta device while every
tensor operation of the build is recorded (``record_build``: shapes, no data, no RNG
drawn); the model is then sharded on meta and ``to_empty`` gives each rank storage for
its shards only; ``replay`` finally re-runs the recorded operations on real CPU tensors,
in order, from the same RNG state, so the RNG stream and every value are bit-identical
to the replicated build, and copies each parameter's local shard out of its full value
as soon as its last operation ran.

Memory: a full tensor lives only from the operation that last overwrote it whole
(``normal_``, ``uniform_``, ``zero_``, ``fill_``, or its creation) to its last use; an
earlier draw into it (``nn.Linear``'s default init, overwritten later by the family's)
is replayed on a scratch tensor and dropped at once, only to advance the RNG. The build's
peak is then the rank's shards plus about one tensor (one layer's stacked experts at
most), not the model. Nothing family-specific is involved: any module whose constructor
runs on the meta device (``ModelFamily.build(cfg, device="meta")``) replays.

A build that draws random numbers into a real (non-meta) tensor, or passes its own
``torch.Generator``, cannot be replayed in step with the RNG; it is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

_aten = torch.ops.aten
_EMPTY = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
          _aten.new_empty.default, _aten.new_empty_strided.default}
_FILLS = {_aten.zero_.default, _aten.fill_.Scalar}  # overwrite without reading the old values


_CPU = torch.device("cpu")


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.device) and x.type == "meta"


class MetaBuildError(RuntimeError):
    """The meta-device build did something its replay could not reproduce."""


@dataclass(frozen=True)
class Ref:
    """A meta tensor of the build: which recorded storage, and its geometry there."""

    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n


@dataclass
class _Op:
    func: Any
    tree: Any  # the (args, kwargs) leaves, tensors as Refs (real tensors kept as constants)
    leaves: list[Any]
    new: list[tuple[int, Ref]]  # (output leaf index, Ref) of each storage this op created
    uses: set[int]  # storages it reads or writes
    starts: set[int]  # storages whose earlier values are dead after it (made or overwritten)


@dataclass
class BuildRecord:
    """What ``record_build`` saw: the operations in order, each storage's bytes, and the
    meta storages' addresses (kept alive, so that no address is reused for another)."""

    ops: list[_Op] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    ids: dict[int, int] = field(default_factory=dict)
    alive: list[torch.Tensor] = field(default_factory=list)

    def ref(self, t: torch.Tensor, what: str) -> Ref:
        key = t.untyped_storage()._cdata
        if key not in self.ids:
            raise MetaBuildError(f"meta build: {what} {tuple(t.shape)} was not made during "
                                 "the recorded build; it has no values to replay")
        return Ref(self.ids[key], tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _covers(ref: Ref, nbytes: int) -> bool:
    """Whether ``ref`` is the whole storage, densely (row-major)."""
    expect, stride = 1, []
    for s in reversed(ref.size):
        stride.append(expect)
        expect *= s
    dense = all(st == e for st, e, sz in zip(ref.stride, reversed(stride), ref.size, strict=True)
                if sz > 1)
    return ref.offset == 0 and dense and ref.numel() * ref.dtype.itemsize == nbytes


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.record = BuildRecord()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:
            raise MetaBuildError(f"meta build: {func} draws from its own torch.Generator; "
                                 "only the global RNG can be replayed in order")
        out = func(*args, **kwargs)
        self._note(func, args, kwargs, out)
        return out

    def _note(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        leaves, tree = tree_flatten((args, kwargs))
        refs: list[Any] = []
        uses: set[int] = set()
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.device.type == "meta":
                r = self.record.ref(x, f"{func} read a meta tensor")
                uses.add(r.storage)
                refs.append(r)
            else:
                refs.append(x)
        outs, _ = tree_flatten(out)
        new: list[tuple[int, Ref]] = []
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor):
                continue
            if t.device.type != "meta":
                if _is_random(func):
                    raise MetaBuildError(f"meta build: {func} drew random numbers into a real "
                                         f"{t.device.type} tensor {tuple(t.shape)}; build every "
                                         "tensor on the meta device")
                continue  # a real constant: later operations keep it as is
            rec, key = self.record, t.untyped_storage()._cdata
            if key in rec.ids:
                continue  # a view or the in-place result: no new storage
            rec.ids[key] = len(rec.nbytes)
            rec.nbytes.append(t.untyped_storage().nbytes())
            rec.alive.append(t)
            r = rec.ref(t, "an output")
            new.append((i, r))
            uses.add(r.storage)
        if not new and not func._schema.is_mutable:
            return  # a view: every later use names its geometry itself
        first = refs[0] if refs and isinstance(refs[0], Ref) else None
        whole = (first is not None and func._schema.is_mutable
                 and (func in _FILLS or _is_random(func))
                 and _covers(first, self.record.nbytes[first.storage])
                 and sum(isinstance(r, Ref) and r.storage == first.storage for r in refs) == 1)
        starts = {r.storage for _, r in new} | ({first.storage} if whole and first else set())
        self.record.ops.append(_Op(func, tree, refs, new, uses, starts))


def record_build(build: Callable[[], nn.Module]) -> tuple[nn.Module, BuildRecord]:
    """Run ``build`` (which must make its tensors on the meta device) while recording."""
    rec = _Recorder()
    with rec:
        model = build()
    return model, rec.record


@dataclass(frozen=True)
class Target:
    """A parameter or buffer of the built model that the replay fills, by name."""

    name: str
    ref: Ref | None  # None: a real tensor the build made (kept in ``const``)
    is_param: bool
    const: torch.Tensor | None = None


def targets(model: nn.Module, record: BuildRecord) -> list[Target]:
    """Every parameter and buffer of ``model`` (tied ones under each name), before it is
    sharded: what ``replay`` writes, and from which recorded storage."""
    out = [Target(n, record.ref(p, f"parameter {n}"), True)
           for n, p in model.named_parameters(remove_duplicate=False)]
    for n, b in model.named_buffers(remove_duplicate=False):
        if b.device.type == "meta":
            out.append(Target(n, record.ref(b, f"buffer {n}"), False))
        else:  # to_empty would drop its values
            out.append(Target(n, None, False, b.detach().clone()))
    return out


@dataclass
class ReplayReport:
    """What one rank's replay did: operations run, the most bytes of full tensors it held
    at once, and the tensors it filled."""

    ops: int = 0
    peak_bytes: int = 0
    filled: int = 0


def _plan(ops: list[_Op]) -> tuple[list[list[int]], list[list[int]]]:
    """After each operation: the storages whose values die there (overwritten whole
    later) and those used for the last time."""
    last: dict[int, int] = {}
    dies: list[list[int]] = [[] for _ in ops]
    for i, op in enumerate(ops):
        for s in op.starts:
            if s in last:
                dies[last[s]].append(s)
        for s in op.uses:
            last[s] = i
    final: list[list[int]] = [[] for _ in ops]
    for s, i in last.items():
        final[i].append(s)
    return dies, final


class _Storages:
    """The real storages of the replay, made on first use and dropped when dead."""

    def __init__(self, nbytes: list[int], report: ReplayReport) -> None:
        self.nbytes, self.report = nbytes, report
        self.real: dict[int, torch.UntypedStorage] = {}
        self.held = 0

    def put(self, s: int, storage: torch.UntypedStorage) -> None:
        self.real[s] = storage
        self.held += self.nbytes[s]
        self.report.peak_bytes = max(self.report.peak_bytes, self.held)

    def view(self, r: Ref) -> torch.Tensor:
        if r.storage not in self.real:
            self.put(r.storage, torch.empty(self.nbytes[r.storage], dtype=torch.uint8).untyped_storage())
        return torch.empty(0, dtype=r.dtype).set_(self.real[r.storage], r.offset, r.size, r.stride)

    def drop(self, s: int) -> None:
        if self.real.pop(s, None) is not None:
            self.held -= self.nbytes[s]


def _run(op: _Op, st: _Storages) -> None:
    if op.func in _EMPTY and not op.func._schema.is_mutable:
        return  # storage only: made on first use
    leaves = [st.view(x) if isinstance(x, Ref) else _CPU if _is_meta(x) else x for x in op.leaves]
    args, kwargs = tree_unflatten(leaves, op.tree)
    outs, _ = tree_flatten(op.func(*args, **kwargs))
    for i, r in op.new:
        t = outs[i]
        if (tuple(t.stride()), t.storage_offset()) != (r.stride, r.offset):
            raise MetaBuildError(f"meta build: {op.func} gave a {tuple(t.shape)} tensor strides "
                                 f"{tuple(t.stride())} on CPU but {r.stride} on meta")
        st.put(r.storage, t.untyped_storage())


def _fill(model: nn.Module, t: Target, full: torch.Tensor) -> None:
    """This rank's piece of ``full`` into the model's tensor ``t.name`` (a DTensor's local
    shard, or the whole tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dest = model.get_parameter(t.name) if t.is_param else model.get_buffer(t.name)
    if tuple(dest.shape) != tuple(full.shape):
        raise MetaBuildError(f"meta build: {t.name} is {tuple(dest.shape)} in the sharded model "
                             f"but {tuple(full.shape)} in the build")
    piece = full
    if isinstance(dest, DTensor):
        shape, offset = compute_local_shape_and_global_offset(dest.shape, dest.device_mesh,
                                                              dest.placements)
        piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        dest = dest.to_local()
    with torch.no_grad():
        dest.copy_(piece)


def _check_ties(model: nn.Module, by_storage: dict[int, list[Target]]) -> None:
    """Parameters that were one tensor in the build (tied embeddings) must still be one:
    filled apart, they would train apart."""
    for ts in by_storage.values():
        params = [t for t in ts if t.is_param and t.ref == ts[0].ref]
        for t in params[1:]:
            if model.get_parameter(t.name) is not model.get_parameter(params[0].name):
                raise MetaBuildError(f"meta build: {params[0].name} and {t.name} were tied in "
                                     "the build but are two tensors now (a plain to_empty "
                                     "unties them; tie them again before the replay)")


def replay(record: BuildRecord, model: nn.Module, wanted: list[Target]) -> ReplayReport:
    """Re-run the recorded build on CPU and fill ``model`` (sharded, its storage made by
    ``to_empty``) with this rank's pieces of the values the build would have made.

    Every rank must start from the RNG state the recorded build started from (the same
    seed): the replay draws exactly what the build on CPU draws, in the same order.
    """
    report = ReplayReport()
    st = _Storages(record.nbytes, report)
    by_storage: dict[int, list[Target]] = {}
    for t in wanted:
        if t.ref is None:
            _fill(model, t, t.const)  # type: ignore[arg-type]
            report.filled += 1
        else:
            by_storage.setdefault(t.ref.storage, []).append(t)
    _check_ties(model, by_storage)
    dies, final = _plan(record.ops)
    for i, op in enumerate(record.ops):
        _run(op, st)
        report.ops += 1
        for s in dies[i]:
            st.drop(s)
        for s in final[i]:
            for t in by_storage.pop(s, []):
                _fill(model, t, st.view(t.ref))  # type: ignore[arg-type]
                report.filled += 1
            st.drop(s)
    if by_storage:  # made before the first recorded operation: cannot happen for a build
        names = [t.name for ts in by_storage.values() for t in ts]
        raise MetaBuildError(f"meta build: no recorded operation made {', '.join(names)}")
    return report
