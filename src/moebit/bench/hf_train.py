"""The training rows of ``moebit bench hf``: one whole training step, timed part by part.

Each rep runs, for transformers and for moebit in turn (interleaved, so a busy host slows
both alike): zero the gradients, forward+backward of the whole model on B x T tokens
(loss + aux loss), then one ``torch.optim.AdamW(fused=True)`` step. The breakdown is
measured INSIDE that same step, so its parts add up to it:

- ``attention`` and ``moe``: every attention and every MoE module, forward and backward.
  Forward time runs from the module's forward pre-hook to its forward hook; backward time
  from the moment the output's gradient arrives to the moment the input's gradient is
  computed (an identity autograd node on each side records the clock; the CPU autograd
  engine runs one node at a time on the calling thread, so the interval is the module's
  own backward);
- ``rest`` = the whole forward+backward minus those two (embedding, norms, residuals,
  LM head and loss, autograd's gradient accumulation);
- ``optimizer``: the AdamW step after it.

A second pair, ``*_bf16_fwd_bwd``, runs the same forward+backward under CPU autocast
(bfloat16; AMX where the CPU has it). Note that transformers' grouped_mm experts cast
their input back to the weights' dtype (``input.to(weight.dtype)``), so under autocast
its experts still compute in float32, while moebit's experts compute in bfloat16.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from typing import Any

import torch


class _Clock(torch.autograd.Function):
    """Identity whose backward records the time the gradient passes (``rec(key)``)."""

    @staticmethod
    def forward(ctx, x, rec, key):  # type: ignore[override]
        ctx.rec, ctx.key = rec, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ctx.rec(ctx.key)
        return g, None, None


class PartTimer:
    """Accumulated wall seconds of named module groups, forward and backward, in one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._t0: dict[int, float] = {}
        self._bwd_start: dict[tuple[str, int], float] = {}
        self._handles: list[Any] = []
        self._n = 0

    def _rec(self, key: tuple[str, int, str]) -> None:
        part, i, side = key
        now = time.perf_counter()
        if side == "out":  # the output's gradient arrived: this module's backward starts
            self._bwd_start[(part, i)] = now
        elif (part, i) in self._bwd_start:
            self.seconds[part] += now - self._bwd_start.pop((part, i))

    def attach(self, modules: list[torch.nn.Module], part: str) -> None:
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre(part), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(part)))

    def _pre(self, part: str) -> Any:
        def hook(m: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            self._n += 1
            m._moebit_timer_id = self._n
            self._t0[id(m)] = time.perf_counter()
            key = (part, self._n, "in")
            if args and torch.is_tensor(args[0]) and args[0].requires_grad:
                args = (_Clock.apply(args[0], self._rec, key), *args[1:])
            elif torch.is_tensor(kwargs.get("hidden_states")) and kwargs["hidden_states"].requires_grad:
                kwargs = {**kwargs, "hidden_states": _Clock.apply(kwargs["hidden_states"],
                                                                  self._rec, key)}
            return args, kwargs
        return hook

    def _post(self, part: str) -> Any:
        def hook(m: torch.nn.Module, args: tuple, out: Any) -> Any:
            self.seconds[part] += time.perf_counter() - self._t0.pop(id(m))
            key = (part, m._moebit_timer_id, "out")
            if torch.is_tensor(out):
                return _Clock.apply(out, self._rec, key)
            if isinstance(out, tuple):
                return (_Clock.apply(out[0], self._rec, key), *out[1:])
            if dataclasses.is_dataclass(out) and hasattr(out, "hidden"):
                return dataclasses.replace(out, hidden=_Clock.apply(out.hidden, self._rec, key))
            return out
        return hook

    def reset(self) -> None:
        self.seconds.clear()
        self._bwd_start.clear()

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _loss(name: str, model: Any, ids: torch.Tensor) -> torch.Tensor:
    if name == "hf":
        return model(ids, labels=ids, output_router_logits=True).loss  # loss + aux loss
    out = model(ids, ids)
    return out.loss + out.aux_loss


def _modules(name: str, model: Any) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    layers = model.model.layers if name == "hf" else model.blocks
    return [la.self_attn for la in layers], [la.mlp for la in layers]


def _one_step(name: str, model: Any, opt: Any, timer: PartTimer, ids: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    timer.reset()
    t0 = time.perf_counter()
    _loss(name, model, ids).backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    att, moe = timer.seconds["attention"], timer.seconds["moe"]
    return {"fwd_bwd": t1 - t0, "attention": att, "moe": moe,
            "rest": t1 - t0 - att - moe, "optimizer": t2 - t1}


def _order(rep: int) -> tuple[str, str]:
    return ("hf", "moebit") if rep % 2 else ("moebit", "hf")


def train_rows(hf: Any, mb: Any, ids: torch.Tensor, reps: int) -> dict[str, float]:
    """Median ms of every part of the whole step, per model (module docstring)."""
    models = {"hf": hf, "moebit": mb}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True) for k, m in models.items()}
    timers = {}
    for k, m in models.items():
        timers[k] = PartTimer()
        att, moe = _modules(k, m)
        timers[k].attach(att, "attention")
        timers[k].attach(moe, "moe")
    runs: dict[str, list[dict]] = {k: [] for k in models}
    for rep in range(reps + 1):  # rep 0 warms up (and creates the optimizer state)
        for k in _order(rep):  # who goes first alternates: neither gets the warmer caches
            r = _one_step(k, models[k], opts[k], timers[k], ids)
            if rep:
                runs[k].append(r)
    for t in timers.values():
        t.detach()
    out: dict[str, float] = {}
    for k, rs in runs.items():
        for part in rs[0]:
            out[f"{k}_{part}_ms"] = round(1e3 * statistics.median(r[part] for r in rs), 1)
    for part in ("fwd_bwd", "moe", "attention", "optimizer"):
        out[f"speedup_{part}"] = round(out[f"hf_{part}_ms"] / out[f"moebit_{part}_ms"], 2)
    for m in models.values():
        m.zero_grad(set_to_none=True)
    return out


def bf16_rows(hf: Any, mb: Any, ids: torch.Tensor, reps: int) -> dict[str, float]:
    """Forward+backward of both models under bfloat16 CPU autocast, interleaved."""
    times: dict[str, list[float]] = {"hf": [], "moebit": []}
    models = {"hf": hf, "moebit": mb}
    for rep in range(reps + 1):
        for k in _order(rep):
            m = models[k]
            m.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(k, m, ids)
            loss.backward()
            if rep:
                times[k].append(time.perf_counter() - t0)
    for m in models.values():
        m.zero_grad(set_to_none=True)
    hf_ms = 1e3 * statistics.median(times["hf"])
    mb_ms = 1e3 * statistics.median(times["moebit"])
    return {"hf_bf16_fwd_bwd_ms": round(hf_ms, 1), "moebit_bf16_fwd_bwd_ms": round(mb_ms, 1),
            "speedup_bf16_fwd_bwd": round(hf_ms / mb_ms, 2)}
