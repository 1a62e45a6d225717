"""The plumbing shared by moebit's compressed optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB).

Each of them keeps its per-parameter moments in FLAT buffers, one per (param group, device,
dtype) "bucket", with per-parameter views: the 1-bit allreduce then compresses a whole
bucket in one collective (one network round trip instead of one per parameter) and writes
the average back in place, copying nothing. What differs between the optimizers is only
``step``; this base owns everything else:

- argument checks that name the argument (``check_hparams``, ``check_step_arg``);
- param groups: per-group ``process_group`` and ``exp_avg_mask``, no new group after the
  freeze (its parameters would have no variance estimate);
- buckets: flat buffers allocated at the first step (or lazily, ``_add_flat``, for buffers
  only one stage needs), exposed as ``opt.state[p][name]`` views;
- gradients: a missing ``.grad`` counts as zero (every rank must issue the same
  collectives on the same layout); exact bucketed averaging for warm-up steps;
- one ``OnebitAllreduce`` per param group (its process group), created on first use;
- ``state_dict``/``load_state_dict``: flat buffers, step, freeze step, this rank's error
  buffers (each rank saves its own), plus whatever a subclass adds in ``_extra_state``.
  The section is called "onebit" for every subclass: the training loop's checkpoint code
  recognises compressed-optimizer state by it;
- ``state_bytes``, ``comm_stage``, ``frozen_at``, ``step_count``.

Training-loop contract: ``averages_gradients = True`` (the optimizer averages over each
group's process group itself; the loop must not). Exception: when
``next_step_averages_exactly`` is True (warm-up), a loop may average the gradients itself,
clip the average exactly as it would for Adam, and call ``grads_are_averaged()``; the
warm-up is then Adam's step bit for bit, clipping included, instead of clipping each
rank's local gradient before the optimizer averages.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from moebit.comm import collectives
from moebit.comm.compressed import OnebitAllreduce
from moebit.optim.buckets import CHUNK, Bucket, chunks, copy_saved_buckets, tensors_in
from moebit.optim.checks import check_hparams, check_range, check_step_arg

__all__ = ["CHUNK", "Bucket", "CompressedOptimizer", "check_hparams", "check_range", "check_step_arg",
           "chunks", "tensors_in"]


class CompressedOptimizer(Optimizer):
    """Base of the 1-bit optimizers.

    ``step`` runs the two stages every member shares: exact warm-up per bucket until
    ``_should_freeze``, then ``_freeze`` and the compressed update per bucket. Subclasses
    implement ``_warmup_bucket``, ``_should_freeze``, ``_freeze`` and ``_compressed_bucket``
    (0/1 Adam, whose stages differ, overrides ``_step`` instead). Other hooks: ``_flat_names``
    (buffers allocated for every bucket at its first step), ``_extra_state``/
    ``_load_extra_state`` (their own counters), ``_after_load``.
    """

    averages_gradients = True
    _flat_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    _scratch_names: tuple[str, ...] = ()  # flat buffers that are not saved (per-step scratch)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        process_group: dist.ProcessGroup | None,
        grads_averaged_externally: bool = False,
    ) -> None:
        check_hparams(defaults["lr"], defaults["betas"], defaults["eps"],
                      defaults["weight_decay"], type(self).__name__)
        self._default_pg = process_group
        defaults = dict(defaults)
        defaults["lr"] = float(defaults["lr"])
        defaults["betas"] = (float(defaults["betas"][0]), float(defaults["betas"][1]))
        defaults["eps"] = float(defaults["eps"])
        defaults["weight_decay"] = float(defaults["weight_decay"])
        defaults["process_group"] = process_group
        self._buckets: list[list[Bucket]] = []
        self._step_count = 0
        self._frozen_at: int | None = None
        self._compressors: dict[int, Any] = {}
        self._preaveraged = False
        super().__init__(params, defaults)
        self.grads_averaged_externally = bool(grads_averaged_externally)

    # ----------------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._build_buckets()
        self._step_count += 1
        self._step(self._step_count)
        self._preaveraged = False
        return loss

    def _step(self, t: int) -> None:
        """Step ``t`` (1-based): warm-up buckets until the freeze, compressed ones after.
        0/1 Adam replaces this whole schedule; the others fill in the per-bucket hooks."""
        if self._frozen_at is None:
            for _, group, b in self._iter_buckets():
                self._warmup_bucket(group, b, t)
            if self._should_freeze(t):
                self._freeze(t)
        else:
            for gi, group, b in self._iter_buckets():
                self._compressed_bucket(gi, group, b, t)

    @property
    def next_step_averages_exactly(self) -> bool:
        """Whether the next ``step()`` averages the gradients exactly (1-bit Adam/LAMB: the
        warm-up). Only then may a caller average them itself and call ``grads_are_averaged``."""
        return self._frozen_at is None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._preaveraged = False  # the mark belongs to the gradients it was given for
        super().zero_grad(set_to_none=set_to_none)

    def grads_are_averaged(self) -> None:
        """Say that this step's ``p.grad`` already hold the average over each group's process
        group (a missing grad counting as zeros), so the next ``step()`` does not average again.

        Lets a training loop clip the averaged gradient, as it does for Adam. Valid for one
        step, and only when ``next_step_averages_exactly`` is True: in the compressed stage
        the optimizer needs each rank's own gradient.
        """
        if not self.next_step_averages_exactly:
            raise RuntimeError(
                f"{type(self).__name__}.grads_are_averaged(): the next step does not average "
                "gradients exactly (the variance is frozen); pass each rank's local gradient"
            )
        self._preaveraged = True

    def _warmup_bucket(self, group: dict[str, Any], b: Bucket, t: int) -> None:
        raise NotImplementedError

    def _should_freeze(self, t: int) -> bool:
        raise NotImplementedError

    def _freeze(self, t: int) -> None:
        raise NotImplementedError

    def _compressed_bucket(self, gi: int, group: dict[str, Any], b: Bucket, t: int) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- public read-outs
    @property
    def comm_stage(self) -> str:
        """"warmup" (exact averaged gradients) or "compressed" (1-bit exchanges)."""
        return "warmup" if self._frozen_at is None else "compressed"

    @property
    def frozen_at(self) -> int | None:
        """The step after which v was frozen (the last warm-up step), or None."""
        return self._frozen_at

    @property
    def step_count(self) -> int:
        return self._step_count

    def _extra_state_tensors(self) -> list[torch.Tensor]:
        """Tensors a subclass holds outside the buckets (counted by ``state_bytes``)."""
        return []

    def state_bytes(self) -> int:
        """Bytes of optimizer state: the flat buffers, extra tensors and the error buffers."""
        seen: set[int] = set()
        total = 0

        def add(t: torch.Tensor) -> None:
            nonlocal total
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()

        for group_buckets in self._buckets:
            for b in group_buckets:
                for t in b.flats.values():
                    add(t)
        for t in self._extra_state_tensors():
            add(t)
        for comp in self._compressors.values():
            for t in tensors_in(comp.state_dict()):
                add(t)
        return total

    # ------------------------------------------------------------------- param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        cls = type(self).__name__
        if getattr(self, "_frozen_at", None) is not None:
            raise ValueError(
                "cannot add a param group after the variance was frozen: the new parameters "
                "would have no variance estimate"
            )
        if param_group.get("amsgrad", False):
            raise ValueError(f"{cls} does not support amsgrad=True in a param group")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                      f"{cls} param group {len(self.param_groups) - 1}")
        mask = g.get("exp_avg_mask")
        if mask is not None and not isinstance(mask, (torch.Tensor, list, tuple)):
            raise ValueError("exp_avg_mask must be a tensor or a list of tensors/None per param")
        if isinstance(mask, (list, tuple)) and len(mask) != len(g["params"]):
            raise ValueError(
                f"exp_avg_mask has {len(mask)} entries but the group has {len(g['params'])} params"
            )

    def _group_pg(self, group: dict[str, Any]) -> dist.ProcessGroup | None:
        return group.get("process_group", self._default_pg)

    def _world(self, group: dict[str, Any]) -> int:
        return collectives.world_size(self._group_pg(group))

    def _build_buckets(self) -> None:
        """Lay out the state of each new group as flat buffers, one per (device, dtype)."""
        for gi in range(len(self._buckets), len(self.param_groups)):
            group = self.param_groups[gi]
            mask = group.get("exp_avg_mask")
            by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
            for pi, p in enumerate(group["params"]):
                if p.requires_grad:
                    by_key.setdefault((p.device, p.dtype), []).append(pi)
            buckets = []
            for k, ((device, dtype), idx) in enumerate(by_key.items()):
                params = [group["params"][i] for i in idx]
                masks: list[torch.Tensor | None] = []
                for i in idx:
                    mi = mask[i] if isinstance(mask, (list, tuple)) else mask
                    if mi is not None:
                        p = group["params"][i]
                        mi = mi.to(device=device, dtype=dtype)
                        try:
                            torch.broadcast_shapes(mi.shape, p.shape)
                        except RuntimeError:
                            raise ValueError(
                                f"exp_avg_mask of shape {tuple(mi.shape)} does not broadcast to "
                                f"param {i} of group {gi} with shape {tuple(p.shape)}"
                            ) from None
                    masks.append(mi)
                name = f"group{gi}" if k == 0 else f"group{gi}.{k}"
                b = Bucket(name, params, masks)
                for p in params:
                    self.state[p] = {}
                for buf in self._flat_names:
                    self._add_flat(b, buf)
                buckets.append(b)
            self._buckets.append(buckets)

    def _add_flat(self, b: Bucket, name: str) -> torch.Tensor:
        """Allocate (zeroed) flat buffer ``name`` of bucket ``b`` and its per-param views."""
        p0 = b.params[0]
        flat = torch.zeros(b.numel, device=p0.device, dtype=p0.dtype)
        views = [t.view_as(p) for t, p in zip(flat.split(b.sizes), b.params, strict=True)]
        b.flats[name] = flat
        b.views[name] = views
        for p, v in zip(b.params, views, strict=True):
            self.state[p][name] = v
        return flat

    def _drop_flat(self, b: Bucket, name: str) -> None:
        """Free a buffer a finished stage no longer needs."""
        b.flats.pop(name, None)
        b.views.pop(name, None)
        for p in b.params:
            self.state[p].pop(name, None)

    def _iter_buckets(self) -> Iterable[tuple[int, dict[str, Any], Bucket]]:
        for gi, group in enumerate(self.param_groups):
            for b in self._buckets[gi]:
                yield gi, group, b

    # ----------------------------------------------------------------------- gradients
    def _grads(self, b: Bucket) -> list[torch.Tensor]:
        """The bucket's gradients, one per param; a missing gradient counts as zero.

        Zero rather than "skip": with data parallelism every rank must run the same
        collectives on the same layout, whether or not its batch touched a parameter.
        """
        grads = []
        for p in b.params:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
            elif g.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (use dense "
                    "embeddings, e.g. nn.Embedding(sparse=False))"
                )
            grads.append(g)
        return grads

    def _average_grads_(self, group: dict[str, Any], grads: list[torch.Tensor], op_name: str) -> bool:
        """Exact bucketed average over the group's ranks, in place (as DDP leaves ``p.grad``).

        Skipped under DDP (``grads_averaged_externally``), after ``grads_are_averaged()`` and on
        one rank. True if the gradients were exchanged (here or by the caller).
        """
        pg = self._group_pg(group)
        if collectives.world_size(pg) == 1 or self.grads_averaged_externally:
            return False
        if self._preaveraged:
            return True
        collectives.allreduce_mean_(grads, pg, op_name=op_name)
        return True

    def _compressor(self, gi: int) -> Any:
        comp = self._compressors.get(gi)
        if comp is None:

            comp = self._compressors[gi] = OnebitAllreduce(group=self._group_pg(self.param_groups[gi]))
        return comp

    def _onebit_average_(self, gi: int, b: Bucket, flat: torch.Tensor, name: str | None = None) -> bool:
        """1-bit average of ``flat`` over group ``gi``'s ranks, in place; True if sent.

        One rank alone has nothing to send, and compressing would only add error.
        """
        if self._world(self.param_groups[gi]) == 1:
            return False
        self._compressor(gi).allreduce(flat, name=name or b.name, out=flat)
        return True

    @staticmethod
    def _apply_masks(b: Bucket, views: list[torch.Tensor]) -> None:
        """Multiply ``exp_avg_mask`` into ``views`` (1-bit cannot encode exact zeros)."""
        for t, mask in zip(views, b.masks, strict=True):
            if mask is not None:
                t.mul_(mask)

    def _corrections(self, group: dict[str, Any], t: int, t2: int | None = None) -> tuple[float, float]:
        """Adam's bias corrections 1-β1^t and 1-β2^t2 (t2: updates of v, default t)."""
        if not getattr(self, "bias_correction", True):
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1.0 - b1**t, 1.0 - b2 ** (t if t2 is None else t2)

    @staticmethod
    def _adam_moments_(b: Bucket, grads: list[torch.Tensor], b1: float, b2: float | None) -> None:
        """m = β1·m + (1-β1)·g, and v = β2·v + (1-β2)·g² unless b2 is None (torch's ops)."""
        torch._foreach_lerp_(b.m_views, grads, 1.0 - b1)
        if b2 is not None:
            torch._foreach_mul_(b.v_views, b2)
            torch._foreach_addcmul_(b.v_views, grads, grads, value=1.0 - b2)

    @staticmethod
    def _adam_apply(
        group: dict[str, Any], b: Bucket, step_size: float, bc2_sqrt: float | None
    ) -> None:
        """p = p·(1 - lr·wd) - step_size·m/(sqrt(v)/bc2_sqrt + eps), torch Adam's exact ops.

        The denominator is built per parameter and in chunks of at most ``CHUNK``
        elements: a fresh allocation of the whole bucket would be a fresh mmap on every
        step, whose page faults cost more on CPU than all the arithmetic here; small
        temporaries are recycled by the allocator.
        """
        if group["weight_decay"] != 0.0:
            torch._foreach_mul_(b.params, 1.0 - group["lr"] * group["weight_decay"])
        eps = group["eps"]
        for p, m, v in zip(b.params, b.m_views, b.v_views, strict=True):
            for pc, mc, vc in chunks(p, m, v):
                denom = vc.sqrt()
                if bc2_sqrt is not None:
                    denom = denom / bc2_sqrt
                pc.addcdiv_(mc, denom.add_(eps), value=-step_size)

    # --------------------------------------------------------------------- checkpoint
    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, ob: dict[str, Any]) -> None:
        pass

    def _after_load(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs on the same world size.

        Process groups are not saved (they are not picklable and belong to the run);
        the loading optimizer keeps its own. The 1-bit error buffers of THIS rank are
        saved: each rank must save its own state_dict.
        """
        self._build_buckets()
        sd = super().state_dict()
        sd["state"] = {}
        for g in sd["param_groups"]:
            g.pop("process_group", None)
        sd["onebit"] = {
            "optimizer": type(self).__name__,
            "step": self._step_count,
            "frozen_at": self._frozen_at,
            "bias_correction": getattr(self, "bias_correction", True),
            "buckets": [
                [{k: v for k, v in b.flats.items() if k not in self._scratch_names} for b in bs]
                for bs in self._buckets
            ],
            "world_sizes": [self._world(g) for g in self.param_groups],
            "compressors": {gi: c.state_dict() for gi, c in self._compressors.items()},
            **self._extra_state(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        cls = type(self).__name__
        ob = state_dict.get("onebit")
        if ob is None:
            raise ValueError(
                f"not a {cls} state_dict (no 'onebit' section); to start {cls} from a "
                "torch Adam checkpoint, copy exp_avg/exp_avg_sq into opt.state[p] instead"
            )
        saved_cls = ob.get("optimizer", "OnebitAdam")
        if saved_cls != cls:
            raise ValueError(f"a {saved_cls} state_dict cannot be loaded into {cls}")
        groups_pg = [g.get("process_group", self._default_pg) for g in self.param_groups]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for g, pg in zip(self.param_groups, groups_pg, strict=True):
            g["process_group"] = pg
        self._buckets = []
        self.state.clear()
        self._build_buckets()
        copy_saved_buckets(ob["buckets"], self._buckets, cls, self._add_flat)
        self._step_count = int(ob["step"])
        self._frozen_at = ob["frozen_at"]
        if hasattr(self, "bias_correction"):
            self.bias_correction = bool(ob.get("bias_correction", True))
        self._load_extra_state(ob)
        self._compressors = {}
        self._after_load()
        now = [collectives.world_size(pg) for pg in groups_pg]
        for key, csd in ob.get("compressors", {}).items():
            gi = int(key)
            if now[gi] > 1:
                # The compressor itself resets (with a warning) on another world size.
                self._compressor(gi).load_state_dict(csd)
            elif tensors_in(csd):
                warnings.warn(
                    f"{cls}: group {gi} now runs on one rank; its saved 1-bit error "
                    "buffers are dropped",
                    stacklevel=2,
                )
