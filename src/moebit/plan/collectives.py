"""Alpha-beta costs of the collectives as moebit runs them, on a ClusterSpec.

Each function returns ``(seconds, bytes_sent_per_rank)``. Bytes are counted the way
``moebit.comm.stats`` records them (what leaves a rank: a ring allreduce of n bytes sends
2(W-1)/W n), so predictions compare with measured ``bytes_sent`` exactly.

Time of a group of ``w`` ranks spread over ``nodes`` nodes (``g`` ranks per node):

- ring allreduce: 2(w-1) steps, each alpha + (n/w)/B, where B is the slowest edge of the
  ring: the node link when the ring leaves a node (one ring edge per node and direction),
  the device link otherwise. On a shared link every rank's chunk of a step queues on the
  same link: w (n/w) / B per step. Groups that run at once (the expert-data-parallel
  groups, one per expert shard) divide a node link, or the shared link, between them.
- all-to-all, flat (pairwise, as gloo and NCCL issue it): (w-1) alpha plus the busiest
  link's bytes over its rate: g (w-g) m through each node link, (g-1) m over each device
  link, w (w-1) m through a shared link.
- all-to-all, hierarchical (DeepSpeed-MoE / Tutel): an intra-node exchange that groups rows
  by destination node, then one message per remote node: (g-1) alpha_intra +
  (nodes-1) alpha_inter, the same node-link bytes, and the intra bytes twice.
- moebit's 1-bit allreduce (comm/compressed.py): an 8-byte all_gather of lengths, then per
  segment two all_to_alls of (w-1) rows of chunk/8 + 4 bytes (packed signs with the chunk's
  float32 scale), chunk = padded_length(segment, w) / w. Segments pipeline: packing
  segment k overlaps the wire time of k-1, so S segments cost
  c + w_seg + (S-1) max(c, w_seg) with c the packing time of one segment.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebit.plan.cluster import ClusterSpec

SEGMENT = 1 << 22  # comm/compressed.py DEFAULT_SEGMENT


def padded_length(n: int, world: int) -> int:
    """comm/compressed.py's: n rounded up to a multiple of 8*world (at least one byte)."""
    step = 8 * world
    return max(1, -(-n // step)) * step


@dataclass(frozen=True)
class Group:
    """``size`` ranks, ``per_node`` of them on each node they occupy; ``share`` groups of
    this kind run at once over each node link (or over the one shared link)."""

    size: int
    per_node: int
    share: int = 1

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.per_node)


def group_of(cluster: ClusterSpec, size: int, stride: int = 1) -> Group:
    """A group of ``size`` ranks taking every ``stride``-th rank (expert-dp groups stride
    across the expert-parallel blocks, moe/parallel.py)."""
    g = cluster.devices_per_node
    per_node = max(1, min(size, g // stride)) if stride <= g else 1
    if cluster.shared_link:
        return Group(size, per_node, max(1, cluster.world // size))
    return Group(size, per_node, max(1, min(g // per_node, cluster.world // size)))


def _alpha(c: ClusterSpec, grp: Group) -> float:
    return c.inter_lat if grp.nodes > 1 or c.shared_link else c.intra_lat


def ring_allreduce(c: ClusterSpec, grp: Group, nbytes: float) -> tuple[float, float]:
    w = grp.size
    if w <= 1 or nbytes <= 0:
        return 0.0, 0.0
    chunk = nbytes / w
    if c.shared_link:
        per_step = grp.share * w * chunk / c.inter_bw
    elif grp.nodes > 1:
        per_step = chunk / min(c.inter_bw / grp.share, c.intra_bw)
    else:
        per_step = chunk / c.intra_bw
    steps = 2 * (w - 1)
    return steps * (_alpha(c, grp) + per_step), 2 * (w - 1) * nbytes / w


def all_to_all(c: ClusterSpec, grp: Group, m: float, hierarchical: bool = False) -> tuple[float, float]:
    """Every rank sends ``m`` bytes to every other rank of the group."""
    w, g = grp.size, min(grp.per_node, grp.size)
    if w <= 1 or m <= 0:
        return 0.0, 0.0
    sent = (w - 1) * m
    if c.shared_link:
        return (w - 1) * c.inter_lat + grp.share * w * (w - 1) * m / c.inter_bw, sent
    n = grp.nodes
    inter = grp.share * g * (w - g) * m / c.inter_bw if n > 1 else 0.0
    if hierarchical and n > 1:
        intra = 2 * (g - 1) * n * m / c.intra_bw
        lat = (g - 1) * c.intra_lat + (n - 1) * c.inter_lat
    else:
        intra = (g - 1) * m / c.intra_bw
        lat = (g - 1) * c.intra_lat + (w - g) * c.inter_lat
    return lat + max(inter, intra), sent


def onebit_segments(n: int, world: int, segment: int = SEGMENT) -> list[int]:
    """The segment lengths comm/compressed.py cuts an n-element buffer into."""
    count = max(1, -(-n // segment))
    seg_len = padded_length(-(-n // count), world)
    return [min(seg_len, n - off) for off in range(0, max(n, 1), seg_len)]


def onebit_allreduce(c: ClusterSpec, grp: Group, n: int,
                     segment: int = SEGMENT) -> tuple[float, float, float]:
    """(seconds, of which packing, bytes sent per rank) of one 1-bit allreduce of n floats.

    Packing is three passes over the elements at ``pack_rate`` (worker compress, server
    decode + recompress, final decode). With S segments the pipeline costs
    p_0 + sum_k max(wire_(k-1), p_k) + wire_(S-1): packing hides behind the wire and back.
    """
    w = grp.size
    if w <= 1:
        return 0.0, 0.0, 0.0
    seconds, sent = all_gather(c, grp, 8)
    wires, packs = [], []
    for length in onebit_segments(n, w, segment):
        row = padded_length(length, w) // w // 8 + 4
        t1, b1 = all_to_all(c, grp, row)
        wires.append(2 * t1)
        packs.append(3 * length / c.pack_rate)
        sent += 2 * b1
    seconds += packs[0] + wires[-1]
    seconds += sum(max(wires[k - 1], packs[k]) for k in range(1, len(wires)))
    return seconds, sum(packs), sent


def all_gather(c: ClusterSpec, grp: Group, nbytes: float) -> tuple[float, float]:
    """Ring all_gather of ``nbytes`` per rank: (w-1) steps of one rank's bytes."""
    w = grp.size
    if w <= 1:
        return 0.0, 0.0
    if c.shared_link:
        per_step = grp.share * w * nbytes / c.inter_bw
    else:
        per_step = nbytes / (min(c.inter_bw / grp.share, c.intra_bw) if grp.nodes > 1
                             else c.intra_bw)
    return (w - 1) * (_alpha(c, grp) + per_step), (w - 1) * nbytes
