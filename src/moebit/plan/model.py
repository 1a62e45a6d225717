"""Step and run times of one training setup on one cluster, optimizer by optimizer.

A step is compute + optimizer update + whatever communication is not hidden:

    compute   = train_flops_per_token x tokens per rank / flops
    update    = parameters held by a rank / update_rate
    exact     = ring allreduce of the dense gradients over the world and of the expert
                gradients over the expert-data-parallel group, in 64 MiB buckets as
                moebit.distributed.allreduce_mean_ sends them; ``overlap`` of it may hide
                behind the backward pass (0 in moebit, which averages after backward)
    onebit    = moebit's 1-bit allreduce per param group (dense / experts) + the 4-byte
                non-finite check the training loop adds when gradients are not averaged
    local     = 0/1 Adam's local steps: only the non-finite check
    all-to-all = 4 exchanges per MoE block (dispatch and combine, forward and backward) of
                tokens x top_k / ep rows of d_model x a2a_bytes to each peer, plus the
                per-expert counts (int64) once per block

Which kind each step is follows the optimizers' schedules (``schedule``): Adam and LAMB
are exact throughout; 1-bit Adam and 1-bit LAMB exact up to the freeze step, compressed
after; 0/1 Adam refreshes the variance exactly on steps t % var_interval == 0 (the interval
doubling every var_update_scaler refreshes) and sends 1-bit gradients otherwise until its
freeze, then takes local steps and synchronises (1-bit) every local_step_interval steps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from moebit.plan import collectives as coll
from moebit.plan.cluster import ClusterSpec
from moebit.plan.spec import ModelSpec, SpecError

OPTIMIZERS = ("adam", "onebit_adam", "zero_one_adam", "onebit_lamb", "lamb")
BUCKET_BYTES = 64 << 20  # moebit.distributed.allreduce_mean_


@dataclass
class Setup:
    micro_batch: int = 16  # sequences per rank per forward/backward
    grad_accum: int = 1  # forward/backward passes per optimizer step (one exchange each step)
    seq_len: int = 0  # 0: the model's
    steps: int = 1000
    freeze_step: int | None = None  # None: 20% of the steps, as moebit train
    ep_size: int = 1
    grad_bytes: int = 4  # moebit averages float32 gradients; DeepSpeed fp16 sends 2
    a2a_bytes: int = 2  # moebit sends tokens in the autocast dtype (bf16)
    hierarchical_a2a: bool = False
    overlap: float = 0.0  # share of the backward pass that exact allreduces hide behind
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16

    def check(self, world: int, model: ModelSpec) -> None:
        for key in ("micro_batch", "grad_accum", "steps", "ep_size", "grad_bytes", "a2a_bytes",
                    "var_update_scaler", "local_step_scaler", "local_step_clipper"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"setup.{key}: must be a positive integer (got {v!r})")
        if self.seq_len < 0:
            raise SpecError(f"setup.seq_len: must be >= 0 (got {self.seq_len})")
        if self.freeze_step is not None and self.freeze_step < 1:
            raise SpecError(f"setup.freeze_step: must be >= 1 (got {self.freeze_step})")
        if not 0.0 <= self.overlap <= 1.0:
            raise SpecError(f"setup.overlap: must be in [0, 1] (got {self.overlap})")
        if world % self.ep_size:
            raise SpecError(f"setup.ep_size: {self.ep_size} does not divide the {world} devices")
        for e in model.experts:
            if e and e % self.ep_size:
                raise SpecError(f"setup.ep_size: {self.ep_size} does not divide {e} experts")

    def freeze(self) -> int:
        return self.freeze_step if self.freeze_step is not None else max(1, round(0.2 * self.steps))


def schedule(optimizer: str, s: Setup) -> list[str]:
    """The kind of each step 1..steps: "exact", "onebit" or "local"."""
    if optimizer not in OPTIMIZERS:
        raise SpecError(f"setup.optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    n, f = s.steps, s.freeze()
    if optimizer in ("adam", "lamb"):
        return ["exact"] * n
    if optimizer in ("onebit_adam", "onebit_lamb"):
        return ["exact" if t <= f else "onebit" for t in range(1, n + 1)]
    kinds: list[str] = []
    var_interval, var_counter = 1, 0
    local_interval, local_counter, since_sync = 1, 0, 0
    for t in range(1, n + 1):
        if t <= f:
            refresh = t % var_interval == 0
            kinds.append("exact" if refresh else "onebit")
            if refresh:
                var_counter += 1
                if var_counter >= s.var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            continue
        since_sync += 1
        sync = since_sync >= local_interval
        kinds.append("onebit" if sync else "local")
        if sync:
            since_sync = 0
        local_counter += 1
        if local_counter >= s.local_step_scaler:
            local_counter = 0
            local_interval = min(2 * local_interval, s.local_step_clipper)
    return kinds


@dataclass
class StepCost:
    seconds: float
    compute: float
    comm: float  # exposed communication, packing included (what moebit's stats time)
    bytes_sent: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _bucketed_allreduce(c: ClusterSpec, grp: coll.Group, nbytes: float) -> tuple[float, float]:
    t = b = 0.0
    left = nbytes
    while left > 0:
        piece = min(left, BUCKET_BYTES)
        dt, db = coll.ring_allreduce(c, grp, piece)
        t, b, left = t + dt, b + db, left - piece
    return t, b


def _a2a(c: ClusterSpec, model: ModelSpec, s: Setup, tokens: int) -> tuple[float, float]:
    """All-to-all time and bytes of one training step (forward and backward)."""
    if not model.is_moe or s.ep_size == 1:
        return 0.0, 0.0
    grp = coll.group_of(c, s.ep_size)
    t = b = 0.0
    for layer in model.moe_layers:
        rows = tokens * model.top_k / s.ep_size
        dt, db = coll.all_to_all(c, grp, rows * model.d_model * s.a2a_bytes, s.hierarchical_a2a)
        ct, cb = coll.all_to_all(c, grp, model.experts[layer] // s.ep_size * 8, s.hierarchical_a2a)
        t, b = t + 4 * dt + ct, b + 4 * db + cb
    # Clipping sums the experts' squared norms over the ep group: a 4-byte allreduce that
    # moebit does not count in its byte stats (train.clip_gradients).
    t += coll.ring_allreduce(c, grp, 4)[0]
    return t, b


def step_costs(model: ModelSpec, c: ClusterSpec, s: Setup) -> dict[str, StepCost]:
    """Cost of an "exact", a "onebit" and a "local" step."""
    w = c.world
    s.check(w, model)
    seq = s.seq_len or model.seq_len
    tokens = s.micro_batch * seq
    held = model.dense_params() + model.expert_total_params() // s.ep_size
    passes = model.train_flops_per_token() * tokens / c.flops
    compute = passes * s.grad_accum + held / c.update_rate
    world = coll.group_of(c, w)
    edp = coll.group_of(c, w // s.ep_size, stride=s.ep_size)
    experts_local = model.expert_total_params() // s.ep_size
    a2a_t, a2a_b = _a2a(c, model, s, tokens)
    a2a_t, a2a_b = a2a_t * s.grad_accum, a2a_b * s.grad_accum
    nan_t, _ = coll.ring_allreduce(c, world, 4)
    nan_b = (2 * (w - 1) * 4) // w

    t_dense, b_dense = _bucketed_allreduce(c, world, model.dense_params() * s.grad_bytes)
    t_exp, b_exp = _bucketed_allreduce(c, edp, experts_local * s.grad_bytes) if experts_local else (0.0, 0.0)
    backward = passes * 2.0 / 3.0  # the last pass's backward (overlap hides behind it)
    exact_comm = max(0.0, t_dense + t_exp - s.overlap * backward) + a2a_t

    o_dense = coll.onebit_allreduce(c, world, model.dense_params())
    o_exp = coll.onebit_allreduce(c, edp, experts_local) if experts_local else (0.0, 0.0, 0.0)
    onebit_comm = o_dense[0] + o_exp[0] + nan_t + a2a_t
    local_comm = nan_t + a2a_t
    return {
        "exact": StepCost(compute + exact_comm, compute, exact_comm, b_dense + b_exp + a2a_b),
        "onebit": StepCost(compute + onebit_comm, compute, onebit_comm,
                           o_dense[2] + o_exp[2] + nan_b + a2a_b),
        "local": StepCost(compute + local_comm, compute, local_comm, nan_b + a2a_b),
    }


def predict(model: ModelSpec, c: ClusterSpec, s: Setup, optimizer: str,
            window: tuple[int, int] | None = None) -> dict[str, Any]:
    """Whole-run and per-step figures of one optimizer; ``window`` (first, last step,
    1-based inclusive) sets which steps the per-step averages cover (default: all)."""
    kinds = schedule(optimizer, s)
    costs = step_costs(model, c, s)
    lo, hi = window or (1, s.steps)
    if not 1 <= lo <= hi <= s.steps:
        raise SpecError(f"setup.window: ({lo}, {hi}) is not inside steps 1..{s.steps}")
    sel = kinds[lo - 1:hi]
    seq = s.seq_len or model.seq_len
    tokens_step = s.micro_batch * s.grad_accum * seq * c.world
    step_s = sum(costs[k].seconds for k in sel) / len(sel)
    counts = {k: kinds.count(k) for k in ("exact", "onebit", "local")}
    run_s = sum(costs[k].seconds * n for k, n in counts.items())
    return {
        "optimizer": optimizer, "world_size": c.world, "n_params": model.total_params(),
        "tokens_per_s": tokens_step / step_s, "step_s": step_s,
        "comm_s_per_step": sum(costs[k].comm for k in sel) / len(sel),
        "compute_s_per_step": sum(costs[k].compute for k in sel) / len(sel),
        "comm_share": sum(costs[k].comm for k in sel) / len(sel) / step_s,
        "bytes_sent": sum(costs[k].bytes_sent * n for k, n in counts.items()),
        "bytes_per_step": {k: costs[k].bytes_sent for k in counts},
        "step_s_by_kind": {k: costs[k].seconds for k in counts},
        "steps_by_kind": counts, "run_s": run_s,
        "frozen_at": None if optimizer in ("adam", "lamb") else min(s.freeze(), s.steps),
        "tokens_per_s_run": tokens_step * s.steps / run_s if math.isfinite(run_s) else 0.0,
    }


def compare(model: ModelSpec, c: ClusterSpec, s: Setup, optimizers: list[str],
            window: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """predict() per optimizer, each with its speed and bytes against the first."""
    rows = [predict(model, c, s, o, window) for o in optimizers]
    base = rows[0]
    for r in rows:
        r["tokens_per_s_vs_first"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["run_speedup_vs_first"] = base["run_s"] / r["run_s"]
        r["bytes_fewer_than_first"] = base["bytes_sent"] / r["bytes_sent"] if r["bytes_sent"] else None
    return rows
