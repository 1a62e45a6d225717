"""The outer sync of DiLoCo / Streaming DiLoCo in ``moebit plan``: bytes, overlap, share.

An outer row (``--optimizers diloco`` or ``streaming_diloco``) trains AdamW inside each
worker and syncs every H inner steps, as ``moebit train --outer`` does
(``moebit.optim.outer``):

    inner step  = compute + the worker's own per-step exchange: with ``--outer-group node``
                  a worker is one node, whose ranks average their dense gradients (and
                  their expert gradients over the ranks of the same ep rank) over the
                  device links every step; with ``world`` every rank is its own worker and
                  exchanges nothing per step; plus the all-to-alls of expert parallelism
    outer sync  = the pseudo-gradient of one fragment (1/F of the held parameters; F = 1
                  for DiLoCo) averaged over the outer group: the same local rank on every
                  node (``node``: all of a node's outer groups share its link at once) or
                  every rank (``world``). Dense and expert parts travel apart, as
                  ``OuterOptimizer._average`` sends them. Per element:
                  none 4 bytes and bf16 2 bytes (ring allreduce), int8 two all-to-all
                  phases of 1 byte + 4 per block of ``int8_block`` (comm/quantize.py),
                  1bit moebit's 1-bit allreduce (comm/compressed.py)
    exposed     = max(0, sync time - D x inner step): a fragment's exchange runs behind
                  the next D inner steps (``--outer-delay``), the rest blocks training
    per step    = inner step + F x exposed / H (F fragment syncs every H steps)

With ``--outer-shard fsdp`` (``--shard fsdp`` under ``--outer-group node``, as ``moebit
train`` composes them) each node's ranks shard its parameters with FSDP2: a rank holds
1/g of the dense parameters and 1/g of all experts (ep x efsdp inside the node), its
inner exchange is an all-gather of each weight in forward and again in backward plus a
reduce-scatter of the gradients over the node, and the outer step syncs only the rank's
shards. Replicated (no ``--outer-shard``), the node's g ranks hold one dense replica and
split each exchange: each syncs 1/g of the dense pseudo-gradient and the node all-gathers
the averages over its own links (``OuterOptimizer``'s share group), so either way the node
link carries the dense model once per sync; sharding also divides the outer state by g.

Peak bytes per step is one fragment's sync (fragments start at offsets i*H/F, so no two
start at the same step when F <= H): 1/F of DiLoCo's. Fragments are priced as equal
slices of the held parameters, as ``outer_fragment_cut=even`` cuts them; the default cut
at block boundaries may differ from 1/F by up to one block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moebit.plan import collectives as coll
from moebit.plan.cluster import ClusterSpec
from moebit.plan.model import OPTIMIZERS, Setup, _a2a, _bucketed_allreduce, predict
from moebit.plan.spec import ModelSpec, SpecError

OUTER_OPTIMIZERS = ("diloco", "streaming_diloco")
COMPRESSIONS = ("none", "bf16", "int8", "1bit")  # optim/outer_compress.py's


@dataclass
class OuterSetup:
    """The ``--outer-*`` settings of the outer rows (the same keys as ``moebit train``)."""

    every: int = 100  # H
    compress: str = "none"
    fragments: int = 0  # 0: 1 for diloco, 4 for streaming_diloco
    delay: int = 0  # D
    group: str = "node"  # node | world
    int8_block: int = 256
    shard: str = "none"  # none | fsdp: parameters sharded inside each node (group node)
    onebit_block: int = 256  # 0: one 1-bit scale per chunk

    def fragments_for(self, optimizer: str) -> int:
        if optimizer == "diloco":
            return 1
        return self.fragments or 4

    def check(self, optimizer: str) -> None:
        for key in ("every", "int8_block"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"setup.outer_{key}: must be a positive integer (got {v!r})")
        ob = self.onebit_block
        if isinstance(ob, bool) or not isinstance(ob, int) or ob < 0 or ob % 8:
            raise SpecError(f"setup.outer_onebit_block: a multiple of 8, or 0 for one scale "
                            f"per chunk (got {ob!r})")
        if self.compress not in COMPRESSIONS:
            raise SpecError(f"setup.outer_compress: {self.compress!r} is not one of "
                            f"{', '.join(COMPRESSIONS)}")
        if self.group not in ("node", "world"):
            raise SpecError(f"setup.outer_group: {self.group!r} is not node or world")
        if self.shard not in ("none", "fsdp"):
            raise SpecError(f"setup.outer_shard: {self.shard!r} is not none or fsdp")
        if self.shard == "fsdp" and self.group != "node":
            raise SpecError("setup.outer_shard: fsdp shards inside a node, so it needs "
                            "outer_group node (moebit train refuses --shard fsdp with "
                            "--outer-group world)")
        f = self.fragments_for(optimizer)
        if f > self.every:
            raise SpecError(f"setup.outer_fragments: {f} fragments do not fit in "
                            f"outer_every {self.every} inner steps")
        if self.delay < 0 or (self.delay and self.delay * f >= self.every):
            raise SpecError(f"setup.outer_delay: must be >= 0 and < outer_every / fragments "
                            f"= {self.every / f:g} (got {self.delay})")


def exchange_cost(c: ClusterSpec, grp: coll.Group, n: int, compress: str,
                  block: int = 256, onebit_block: int = 256) -> tuple[float, float]:
    """(seconds, bytes sent per rank) of averaging ``n`` float32 elements over ``grp`` as
    ``moebit.optim.outer_compress`` does for ``compress``."""
    w = grp.size
    if w <= 1 or n <= 0:
        return 0.0, 0.0
    if compress in ("none", "bf16"):
        return coll.ring_allreduce(c, grp, n * (4 if compress == "none" else 2))
    if compress == "int8":
        chunk = -(-n // (w * block)) * block  # elements per rank, padded (Int8Allreduce)
        row = chunk * (1 + 4 / block)  # int8 values + a float32 scale per block, to each peer
        t, b = coll.all_to_all(c, grp, row)
        return 2 * t + 4 * n / c.pack_rate, 2 * b  # two phases; quantize, dequantize twice
    if onebit_block:  # signs + a float32 scale per block, two phases (onebit_blocks)
        chunk = -(-n // (w * onebit_block)) * onebit_block
        t, b = coll.all_to_all(c, grp, chunk / 8 + 4 * chunk / onebit_block)
        return 2 * t + 3 * n / c.pack_rate, 2 * b
    seconds, _, sent = coll.onebit_allreduce(c, grp, n)
    return seconds, sent


def outer_groups(c: ClusterSpec, mode: str, ep_size: int) -> tuple[coll.Group, coll.Group | None,
                                                                   coll.Group | None]:
    """(outer group, inner dense group, inner expert group) for ``--outer-group mode``."""
    g = c.devices_per_node
    if mode == "world":
        return coll.group_of(c, c.world), None, None
    if g % ep_size:
        raise SpecError(f"setup.ep_size: {ep_size} does not divide the {g} devices of a node "
                        "(--outer-group node keeps expert parallelism inside a node)")
    outer = coll.group_of(c, c.nodes, stride=g)
    return outer, coll.group_of(c, g), coll.group_of(c, g // ep_size, stride=ep_size)


def predict_outer(model: ModelSpec, c: ClusterSpec, s: Setup, optimizer: str,
                  o: OuterSetup) -> dict[str, Any]:
    """A ``predict()``-shaped row for an outer optimizer, with its ``outer`` section."""
    s.check(c.world, model)
    o.check(optimizer)
    frags = o.fragments_for(optimizer)
    seq = s.seq_len or model.seq_len
    tokens = s.micro_batch * seq
    experts = model.expert_total_params() // s.ep_size
    dense = model.dense_params()
    outer, inner, inner_exp = outer_groups(c, o.group, s.ep_size)
    sharded = o.shard == "fsdp" and inner is not None and inner.size > 1
    if sharded:  # a rank's shards: 1/g of the dense weights, 1/(g/ep) of its ep rank's experts
        dense, experts = -(-dense // inner.size), -(-experts * s.ep_size // inner.size)
    passes = model.train_flops_per_token() * tokens / c.flops
    compute = passes * s.grad_accum + (dense + experts) / c.update_rate
    a2a_t, a2a_b = (x * s.grad_accum for x in _a2a(c, model, s, tokens))
    inner_t = inner_b = 0.0
    if sharded:
        inner_t, inner_b = _fsdp_step(c, inner, dense, s.grad_bytes, s.grad_accum)
        if experts and inner_exp is not None:
            et, eb = _fsdp_step(c, inner_exp, experts, s.grad_bytes, s.grad_accum)
            inner_t, inner_b = inner_t + et, inner_b + eb
    elif inner is not None:
        inner_t, inner_b = _bucketed_allreduce(c, inner, dense * s.grad_bytes)
        if experts and inner_exp is not None:
            et, eb = _bucketed_allreduce(c, inner_exp, experts * s.grad_bytes)
            inner_t, inner_b = inner_t + et, inner_b + eb
    inner_step = compute + inner_t + a2a_t
    split = (not sharded and o.group == "node" and inner is not None and inner.size > 1
             and outer.size > 1)
    sent_dense = -(-dense // inner.size) if split and inner is not None else dense
    parts = [-(-sent_dense // frags)] + ([-(-experts // frags)] if experts else [])
    costs = [exchange_cost(c, outer, n, o.compress, o.int8_block, o.onebit_block)
             for n in parts]
    sync_s, sync_b = sum(t for t, _ in costs), sum(b for _, b in costs)
    if split and inner is not None:  # the node all-gathers its ranks' averaged slices
        sync_s += coll.all_gather(c, inner, 4 * parts[0])[0]
    exposed = max(0.0, sync_s - o.delay * inner_step)
    outer_per_step = frags * exposed / o.every
    step_s = inner_step + outer_per_step
    syncs = frags * (s.steps // o.every)  # fragment syncs in the run (whole intervals)
    inner_bytes = (inner_b + a2a_b) * s.steps
    outer_bytes = sync_b * syncs
    tokens_step = tokens * s.grad_accum * c.world
    comm = inner_t + a2a_t + outer_per_step
    crosses = o.group == "world" and outer.nodes > 1 or o.group == "node" and c.nodes > 1
    section = {
        "every": o.every, "compress": o.compress, "fragments": frags, "delay": o.delay,
        "group": o.group, "shard": o.shard if sharded else "none",
        "held_params_per_rank": dense + experts, "outer_group_size": outer.size, "syncs": syncs,
        "bytes_per_sync": sync_b, "bytes_per_step": frags * sync_b / o.every,
        "peak_bytes_per_step": sync_b, "sync_s": sync_s, "hidden_s": sync_s - exposed,
        "exposed_s_per_sync": exposed, "outer_s_per_step": outer_per_step,
        "outer_share": outer_per_step / step_s,
        # bytes that cross the node link per token trained (every rank's outer bytes when
        # the outer group spans nodes; the inner exchange stays inside a node)
        "inter_node_bytes_per_token": (c.world * frags * sync_b / o.every / tokens_step
                                       if crosses else 0.0),
    }
    run_s = step_s * s.steps
    return {
        "optimizer": f"{optimizer}({o.compress})", "world_size": c.world,
        "n_params": model.total_params(), "tokens_per_s": tokens_step / step_s, "step_s": step_s,
        "comm_s_per_step": comm, "compute_s_per_step": compute, "comm_share": comm / step_s,
        "bytes_sent": inner_bytes + outer_bytes,
        "bytes_per_step": {"exact": inner_b + a2a_b, "outer": section["bytes_per_step"]},
        "step_s_by_kind": {"exact": inner_step, "outer": outer_per_step},
        "steps_by_kind": {"exact": s.steps, "onebit": 0, "local": 0}, "run_s": run_s,
        "frozen_at": None, "tokens_per_s_run": tokens_step * s.steps / run_s, "outer": section,
    }


def _fsdp_step(c: ClusterSpec, grp: coll.Group, shard: int, grad_bytes: int,
               passes: int) -> tuple[float, float]:
    """(seconds, bytes sent per rank) of FSDP2's collectives for a rank holding ``shard``
    float32 elements: per forward/backward pass an all-gather in forward and another in
    backward (``reshard_after_forward``, the default), and one reduce-scatter of the
    gradients (a ring moves the same bytes as an all-gather of the shard)."""
    gt, gb = coll.all_gather(c, grp, 4 * shard)
    rt, rb = coll.all_gather(c, grp, grad_bytes * shard)
    return passes * (2 * gt + rt), passes * (2 * gb + rb)


def compare_all(model: ModelSpec, c: ClusterSpec, s: Setup, optimizers: list[str],
                outer: OuterSetup, compressions: list[str] | None = None) -> list[dict[str, Any]]:
    """``model.compare`` over plain and outer optimizers: an outer one gives a row per
    compression in ``compressions`` (default: ``outer.compress``)."""
    rows = []
    for name in optimizers:
        if name in OUTER_OPTIMIZERS:
            for comp in compressions or [outer.compress]:
                rows.append(predict_outer(model, c, s, name,
                                          OuterSetup(**{**asdict(outer), "compress": comp})))
        elif name in OPTIMIZERS:
            rows.append(predict(model, c, s, name))
        else:
            raise SpecError(f"setup.optimizer: {name!r} is not one of "
                            f"{', '.join(OPTIMIZERS + OUTER_OPTIMIZERS)}")
    base = rows[0]
    for r in rows:
        r["tokens_per_s_vs_first"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["run_speedup_vs_first"] = base["run_s"] / r["run_s"]
        r["bytes_fewer_than_first"] = base["bytes_sent"] / r["bytes_sent"] if r["bytes_sent"] else None
    return rows


def format_outer(rows: list[dict[str, Any]]) -> str:
    """The outer rows' sync: bytes per sync / per step / peak, overlap and share."""
    outer = [r for r in rows if "outer" in r]
    if not outer:
        return ""
    head = ["outer row", "H", "F", "D", "group", "MB/sync", "MB/step", "peak MB/step",
            "sync s", "hidden s", "outer s/step", "share of step", "node-link B/token"]
    body = []
    for r in outer:
        o = r["outer"]
        body.append([r["optimizer"], str(o["every"]), str(o["fragments"]), str(o["delay"]),
                     f"{o['group']} ({o['outer_group_size']})"
                     + (", fsdp in nodes" if o["shard"] == "fsdp" else ""),
                     f"{o['bytes_per_sync'] / 1e6:.4g}", f"{o['bytes_per_step'] / 1e6:.4g}",
                     f"{o['peak_bytes_per_step'] / 1e6:.4g}", f"{o['sync_s']:.4g}",
                     f"{o['hidden_s']:.4g}", f"{o['outer_s_per_step']:.4g}",
                     f"{100 * o['outer_share']:.1f}%", f"{o['inter_node_bytes_per_token']:.4g}"])
    w = [max(len(h), *(len(x[i]) for x in body)) for i, h in enumerate(head)]
    line = "  ".join(f"{{:<{n}}}" for n in w)
    return "\n".join(["outer sync (bytes per rank; hidden: behind --outer-delay inner steps)",
                      line.format(*head), line.format(*("-" * n for n in w))]
                     + [line.format(*x) for x in body])
