"""1-bit Adam: exact Adam during warm-up, then only 1-bit momentum crosses the network.

Algorithm (DESIGN.md section 4; Tang et al. 2021, arXiv:2102.02888):

- warm-up (steps 1..freeze_step): Adam(W) on gradients averaged over each param group's
  process group. Standalone, the optimizer averages them itself with one bucketed exact
  allreduce per group; under DDP (``grads_averaged_externally=True``) DDP has done it.
- freeze: v is frozen for good and becomes a fixed preconditioner.
- compression stage: m = β1·m + (1-β1)·g_local; the momenta of a group, which live in one
  flat buffer, go through ONE error-compensated 1-bit allreduce; the group's
  ``exp_avg_mask`` is applied; p -= lr·(m̂ / (sqrt(v̂) + eps) + wd·p).

Bias correction (DeepSpeed has none). Warm-up keeps Adam's corrections, so warm-up IS
torch's Adam/AdamW (bit for bit on one rank). At the freeze, v's correction 1/(1-β2^T)
is folded into v once: the frozen preconditioner is the unbiased estimate at step T, not
one that stays too small forever (with T=100 and β2=0.999 an uncorrected v is 10x too
small, i.e. 3x too large steps for the rest of the run). m keeps its scalar correction
1/(1-β1^t): m is still the same EMA after the freeze (of averaged gradients, through the
compressed allreduce), the factor costs nothing and is ~1 once t >> 1/(1-β1), and keeping
it makes the first compressed step continue the warm-up trajectory exactly.

Memory. m and v of a group are each ONE flat buffer per (device, dtype); the per-parameter
``state[p]["exp_avg"]`` and ``["exp_avg_sq"]`` are views into them, so handing m to the
allreduce copies nothing (it writes the average in place). The compressor adds a worker
error (n, fp32) and a server error (n/W, its chunk padded to 8·W) after the freeze:
(2 + 1 + 1/W)·n against torch Adam's 2·n, i.e. 1.75x at W=2, 1.625x at W=4 (measured).
``freeze_step="auto"`` keeps one snapshot of sqrt(v̂) during warm-up only (1.5x), dropped
at the freeze. No step allocates a model-sized temporary (see ``_apply``).

Training-loop contract: ``averages_gradients = True`` tells a loop not to allreduce
gradients itself; ``comm_stage`` and ``frozen_at`` are there to be logged.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from moebit import distributed as mdist
from moebit.optim.freeze import AutoFreeze

logger = logging.getLogger("moebit.optim")

_CHUNK = 1 << 18  # elements per temporary in the update (1 MiB of fp32)


class FreezableHookState(Protocol):
    """What the optimizer needs from a DDP comm-hook state: a way to silence it."""

    def freeze(self) -> None: ...


@dataclass
class _Bucket:
    """Trainable params of one group sharing (device, dtype); m and v each one flat buffer."""

    name: str
    params: list[torch.Tensor]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    m_views: list[torch.Tensor]
    v_views: list[torch.Tensor]
    masks: list[torch.Tensor | None]

    @property
    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]


def _check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str) -> None:
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr >= 0.0:
        raise ValueError(f"{where}: invalid learning rate {lr!r} (must be a number >= 0)")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}") from None
    for i, b in enumerate((b1, b2)):
        if not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"{where}: invalid beta{i + 1} {b!r} (must be in [0, 1))")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"{where}: invalid eps {eps!r} (must be >= 0)")
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"{where}: invalid weight_decay {weight_decay!r} (must be >= 0)")


def _check_freeze_step(freeze_step: Any) -> None:
    if freeze_step == "auto":
        return
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(
            f"invalid freeze_step {freeze_step!r}: expected an int >= 1 (the number of exact "
            "Adam warm-up steps; the frozen variance needs at least one) or 'auto'"
        )


class OnebitAdam(Optimizer):
    """1-bit Adam; see the module docstring for the algorithm and its choices.

    Args:
        params: parameters or param groups. A group may carry ``process_group`` (its
            gradients and momenta are averaged over that group, e.g. an expert-data-parallel
            group for MoE experts) and ``exp_avg_mask`` (a tensor broadcastable to each of
            the group's params, or a list with one tensor/None per param), multiplied into
            m after each compressed allreduce since 1-bit cannot encode exact zeros.
        lr, betas, eps, weight_decay: as in AdamW (weight decay is decoupled).
        freeze_step: number of exact warm-up steps, or "auto" (``moebit.optim.freeze``).
        process_group: default group of the param groups (None: the world); also the group
            over which the auto-freeze decision is agreed.
        bias_correction: Adam's bias correction (see module docstring); False reproduces
            DeepSpeed's uncorrected variant.
        grads_averaged_externally: True under DDP: gradients arrive already averaged in
            warm-up, so the optimizer sends nothing then.
        ddp_hook_state: the state of moebit's freezable DDP hook; ``freeze()`` is called at
            the freeze so DDP stops allreducing gradients.
        auto_freeze: thresholds of the auto rule, an ``AutoFreeze`` or a dict of its
            fields (default ``AutoFreeze()``).
        amsgrad: accepted only as False (AMSGrad's running max of v has no 1-bit analogue).
    """

    averages_gradients = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str = "auto",
        process_group: dist.ProcessGroup | None = None,
        *,
        bias_correction: bool = True,
        grads_averaged_externally: bool = False,
        ddp_hook_state: FreezableHookState | None = None,
        auto_freeze: AutoFreeze | dict[str, Any] | None = None,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "OnebitAdam does not support amsgrad=True: the running maximum of v cannot be "
                "kept once v is frozen and only 1-bit momentum is exchanged"
            )
        _check_hparams(lr, betas, eps, weight_decay, "OnebitAdam")
        _check_freeze_step(freeze_step)
        if auto_freeze is not None and freeze_step != "auto":
            raise ValueError("auto_freeze thresholds were given but freeze_step is not 'auto'")
        if ddp_hook_state is not None and not grads_averaged_externally:
            raise ValueError(
                "ddp_hook_state is for use under DDP: pass grads_averaged_externally=True too "
                "(otherwise gradients would be averaged twice)"
            )
        self._default_pg = process_group
        defaults = dict(
            lr=float(lr),
            betas=(float(betas[0]), float(betas[1])),
            eps=float(eps),
            weight_decay=float(weight_decay),
            process_group=process_group,
        )
        self._buckets: list[list[_Bucket]] = []
        self._step_count = 0
        self._frozen_at: int | None = None
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.bias_correction = bool(bias_correction)
        self.grads_averaged_externally = bool(grads_averaged_externally)
        self.ddp_hook_state = ddp_hook_state
        if isinstance(auto_freeze, dict):  # from a config file: AutoFreeze's field names
            auto_freeze = AutoFreeze(**auto_freeze)
        self.auto_freeze = (auto_freeze or AutoFreeze()) if freeze_step == "auto" else None
        self._compressors: dict[int, Any] = {}
        self._warned_ddp = False

    # ----------------------------------------------------------------- public read-outs
    @property
    def comm_stage(self) -> str:
        """"warmup" (exact averaged gradients) or "compressed" (1-bit momentum)."""
        return "warmup" if self._frozen_at is None else "compressed"

    @property
    def frozen_at(self) -> int | None:
        """The step after which v was frozen (the last warm-up step), or None."""
        return self._frozen_at

    @property
    def step_count(self) -> int:
        return self._step_count

    def state_bytes(self) -> int:
        """Bytes of optimizer state: m, v, the auto-freeze snapshot and the error buffers."""
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
                add(b.exp_avg)
                add(b.exp_avg_sq)
        if self.auto_freeze is not None and self.auto_freeze.snapshot is not None:
            for t in self.auto_freeze.snapshot:
                add(t)
        for comp in self._compressors.values():
            for t in _tensors_in(comp.state_dict()):
                add(t)
        return total

    # ------------------------------------------------------------------- param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_frozen_at", None) is not None:
            raise ValueError(
                "cannot add a param group after the variance was frozen: the new parameters "
                "would have no variance estimate"
            )
        if param_group.get("amsgrad", False):
            raise ValueError("OnebitAdam does not support amsgrad=True in a param group")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        _check_hparams(
            g["lr"], g["betas"], g["eps"], g["weight_decay"],
            f"OnebitAdam param group {len(self.param_groups) - 1}",
        )
        mask = g.get("exp_avg_mask")
        if mask is not None and not isinstance(mask, (torch.Tensor, list, tuple)):
            raise ValueError("exp_avg_mask must be a tensor or a list of tensors/None per param")
        if isinstance(mask, (list, tuple)) and len(mask) != len(g["params"]):
            raise ValueError(
                f"exp_avg_mask has {len(mask)} entries but the group has {len(g['params'])} params"
            )

    def _group_pg(self, group: dict[str, Any]) -> dist.ProcessGroup | None:
        return group.get("process_group", self._default_pg)

    def _build_buckets(self) -> None:
        """Lay out m and v of each new group as flat buffers, one per (device, dtype)."""
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
                n = sum(p.numel() for p in params)
                m = torch.zeros(n, device=device, dtype=dtype)
                v = torch.zeros(n, device=device, dtype=dtype)
                sizes = [p.numel() for p in params]
                m_views = [t.view_as(p) for t, p in zip(m.split(sizes), params, strict=True)]
                v_views = [t.view_as(p) for t, p in zip(v.split(sizes), params, strict=True)]
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
                buckets.append(_Bucket(name, params, m, v, m_views, v_views, masks))
                for p, mv, vv in zip(params, m_views, v_views, strict=True):
                    self.state[p] = {"exp_avg": mv, "exp_avg_sq": vv}
            self._buckets.append(buckets)

    # ----------------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._build_buckets()
        self._step_count += 1
        t = self._step_count
        if self._frozen_at is None:
            for gi, group in enumerate(self.param_groups):
                for b in self._buckets[gi]:
                    self._warmup_bucket(group, b, t)
            if self._should_freeze(t):
                self._freeze(t)
        else:
            for gi, group in enumerate(self.param_groups):
                for b in self._buckets[gi]:
                    self._compressed_bucket(gi, group, b, t)
        return loss

    def _grads(self, b: _Bucket) -> list[torch.Tensor]:
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
                    "OnebitAdam does not support sparse gradients (use dense embeddings, "
                    "e.g. nn.Embedding(sparse=False))"
                )
            grads.append(g)
        return grads

    def _corrections(self, group: dict[str, Any], t: int) -> tuple[float, float]:
        if not self.bias_correction:
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1.0 - b1**t, 1.0 - b2**t

    def _warmup_bucket(self, group: dict[str, Any], b: _Bucket, t: int) -> None:
        """Adam on averaged gradients; after it, ``p.grad`` holds the average (as with DDP)."""
        grads = self._grads(b)
        pg = self._group_pg(group)
        if not self.grads_averaged_externally and mdist.world_size(pg) > 1:
            mdist.allreduce_mean_(grads, pg, op_name="onebit_adam.warmup")
        b1, b2 = group["betas"]
        torch._foreach_lerp_(b.m_views, grads, 1.0 - b1)
        torch._foreach_mul_(b.v_views, b2)
        torch._foreach_addcmul_(b.v_views, grads, grads, value=1.0 - b2)
        del grads
        bc1, bc2 = self._corrections(group, t)
        self._apply(group, b, group["lr"] / bc1, math.sqrt(bc2))

    def _compressed_bucket(self, gi: int, group: dict[str, Any], b: _Bucket, t: int) -> None:
        grads = self._grads(b)
        b1, _ = group["betas"]
        torch._foreach_lerp_(b.m_views, grads, 1.0 - b1)
        del grads
        pg = self._group_pg(group)
        if mdist.world_size(pg) > 1:
            # In place: the compressor keeps its own copy of what it has not yet delivered.
            # One rank alone has nothing to send, and compressing would only add error.
            self._compressor(gi, pg).allreduce(b.exp_avg, name=b.name, out=b.exp_avg)
        for mv, mask in zip(b.m_views, b.masks, strict=True):
            if mask is not None:
                mv.mul_(mask)
        bc1, _ = self._corrections(group, t)
        self._apply(group, b, group["lr"] / bc1, None)  # v̂ was bias-corrected at the freeze

    def _apply(
        self, group: dict[str, Any], b: _Bucket, step_size: float, bc2_sqrt: float | None
    ) -> None:
        """p = p·(1 - lr·wd) - step_size·m/(sqrt(v)/bc2_sqrt + eps), torch Adam's exact ops.

        The denominator is built per parameter and in chunks of at most ``_CHUNK``
        elements: a fresh allocation of the whole bucket would be a fresh mmap on every
        step, whose page faults cost more on CPU than all the arithmetic here; small
        temporaries are recycled by the allocator.
        """
        if group["weight_decay"] != 0.0:
            torch._foreach_mul_(b.params, 1.0 - group["lr"] * group["weight_decay"])
        eps = group["eps"]
        for p, m, v in zip(b.params, b.m_views, b.v_views, strict=True):
            if p.numel() > _CHUNK and p.is_contiguous():
                pairs = zip(
                    p.view(-1).split(_CHUNK), m.view(-1).split(_CHUNK), v.view(-1).split(_CHUNK),
                    strict=True,
                )
            else:
                pairs = iter([(p, m, v)])
            for pc, mc, vc in pairs:
                denom = vc.sqrt()
                if bc2_sqrt is not None:
                    denom = denom / bc2_sqrt
                pc.addcdiv_(mc, denom.add_(eps), value=-step_size)

    def _compressor(self, gi: int, pg: dist.ProcessGroup | None) -> Any:
        comp = self._compressors.get(gi)
        if comp is None:
            from moebit.comm.compressed import OnebitAllreduce

            comp = self._compressors[gi] = OnebitAllreduce(group=pg)
        return comp

    # ------------------------------------------------------------------------- freeze
    def _should_freeze(self, t: int) -> bool:
        if self.auto_freeze is None:
            return t >= int(self.freeze_step)
        vs = [b.exp_avg_sq for bs in self._buckets for b in bs]
        if not vs:
            return False
        # The correction of the first group stands for all: groups rarely differ in β2,
        # and the rule only needs a consistent scale between two snapshots.
        _, bc2 = self._corrections(self.param_groups[0], t)
        lr = max(float(g["lr"]) for g in self.param_groups)
        return self.auto_freeze.observe(t, vs, bc2, self._default_pg, lr=lr)

    def _freeze(self, t: int) -> None:
        """Freeze v after warm-up step ``t``, folding in its bias correction once."""
        for gi, group in enumerate(self.param_groups):
            _, bc2 = self._corrections(group, t)
            for b in self._buckets[gi]:
                b.exp_avg_sq.div_(bc2)
        self._frozen_at = t
        if self.auto_freeze is not None:
            self.auto_freeze.release()
        self._freeze_hook()
        how = "auto" if self.auto_freeze is not None else f"freeze_step={self.freeze_step}"
        drift = "" if self.auto_freeze is None else f", drift {self.auto_freeze.last_drift:.4g}"
        logger.info(
            "OnebitAdam: variance frozen after step %d (%s%s); 1-bit momentum from now on",
            t, how, drift,
        )

    def _freeze_hook(self) -> None:
        if self.ddp_hook_state is not None:
            self.ddp_hook_state.freeze()
        elif self.grads_averaged_externally and not self._warned_ddp:
            self._warned_ddp = True
            warnings.warn(
                "OnebitAdam froze its variance but has no ddp_hook_state: DDP keeps "
                "allreducing exact gradients, so nothing is saved. Register moebit's freezable "
                "DDP hook and pass its state as ddp_hook_state.",
                stacklevel=3,
            )

    # --------------------------------------------------------------------- checkpoint
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
            "step": self._step_count,
            "frozen_at": self._frozen_at,
            "bias_correction": self.bias_correction,
            "buckets": [
                [{"exp_avg": b.exp_avg, "exp_avg_sq": b.exp_avg_sq} for b in bs]
                for bs in self._buckets
            ],
            "world_sizes": [mdist.world_size(self._group_pg(g)) for g in self.param_groups],
            "compressors": {gi: c.state_dict() for gi, c in self._compressors.items()},
            "auto_freeze": None if self.auto_freeze is None else self.auto_freeze.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "onebit" not in state_dict:
            raise ValueError(
                "not a OnebitAdam state_dict (no 'onebit' section); to start 1-bit Adam from a "
                "torch Adam checkpoint, copy exp_avg/exp_avg_sq into opt.state[p] instead"
            )
        ob = state_dict["onebit"]
        groups_pg = [g.get("process_group", self._default_pg) for g in self.param_groups]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for g, pg in zip(self.param_groups, groups_pg, strict=True):
            g["process_group"] = pg
        self._buckets = []
        self._build_buckets()
        saved = ob["buckets"]
        if len(saved) != len(self._buckets) or any(
            len(s) != len(b) for s, b in zip(saved, self._buckets, strict=True)
        ):
            raise ValueError("OnebitAdam state_dict does not match these param groups")
        for s_group, b_group in zip(saved, self._buckets, strict=True):
            for s, b in zip(s_group, b_group, strict=True):
                if s["exp_avg"].numel() != b.exp_avg.numel():
                    raise ValueError(
                        f"OnebitAdam state_dict bucket {b.name} holds {s['exp_avg'].numel()} "
                        f"elements, these params {b.exp_avg.numel()}"
                    )
                b.exp_avg.copy_(s["exp_avg"])
                b.exp_avg_sq.copy_(s["exp_avg_sq"])
        self._step_count = int(ob["step"])
        self._frozen_at = ob["frozen_at"]
        self.bias_correction = bool(ob.get("bias_correction", True))
        if self.auto_freeze is not None and ob.get("auto_freeze") is not None:
            self.auto_freeze.load_state_dict(ob["auto_freeze"])
        self._compressors = {}
        if self._frozen_at is not None:
            self._freeze_hook()
            now = [mdist.world_size(pg) for pg in groups_pg]
            for key, csd in ob.get("compressors", {}).items():
                gi = int(key)
                if now[gi] > 1:
                    # The compressor itself resets (with a warning) on another world size.
                    self._compressor(gi, groups_pg[gi]).load_state_dict(csd)
                elif _tensors_in(csd):
                    warnings.warn(
                        f"OnebitAdam: group {gi} now runs on one rank; its saved 1-bit error "
                        "buffers are dropped",
                        stacklevel=2,
                    )


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """All tensors nested in dicts/lists/tuples (to count a compressor's error buffers)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v)]
    return []
