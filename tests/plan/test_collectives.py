"""The alpha-beta terms against hand-computed cases."""

from __future__ import annotations

import pytest

from moebit.plan import collectives as coll
from moebit.plan.cluster import ClusterSpec

MB = 1e6


def one_node(w: int, **kw: object) -> ClusterSpec:
    base = dict(nodes=1, devices_per_node=w, intra_bw=1e9, intra_lat=1e-5, inter_bw=1e8,
                inter_lat=1e-4)
    base.update(kw)
    return ClusterSpec(**base)  # type: ignore[arg-type]


def test_ring_allreduce_one_node() -> None:
    # 4 ranks, 8 MB: 6 steps of (10 us + 2 MB / 1 GB/s) = 6 x 2.01 ms; sends 2*3/4*8 MB.
    t, b = coll.ring_allreduce(one_node(4), coll.Group(4, 4), 8 * MB)
    assert t == pytest.approx(6 * (1e-5 + 2e-3))
    assert b == pytest.approx(12 * MB)


def test_ring_allreduce_across_nodes_is_bound_by_the_node_link() -> None:
    c = ClusterSpec(nodes=2, devices_per_node=4, intra_bw=1e9, intra_lat=0, inter_bw=1e8,
                    inter_lat=1e-4)
    t, b = coll.ring_allreduce(c, coll.Group(8, 4), 8 * MB)
    assert t == pytest.approx(14 * (1e-4 + 1 * MB / 1e8))
    assert b == pytest.approx(2 * 7 / 8 * 8 * MB)


def test_ring_allreduce_on_a_shared_link() -> None:
    # every rank's 2 MB chunk of a step queues on the same 100 MB/s link
    c = one_node(4, shared_link=True, inter_lat=0.0)
    t, _ = coll.ring_allreduce(c, coll.Group(4, 4), 8 * MB)
    assert t == pytest.approx(6 * 4 * 2 * MB / 1e8)


def test_world_one_costs_nothing() -> None:
    c = one_node(1)
    assert coll.ring_allreduce(c, coll.Group(1, 1), 1e9) == (0.0, 0.0)
    assert coll.all_to_all(c, coll.Group(1, 1), 1e9) == (0.0, 0.0)
    assert coll.onebit_allreduce(c, coll.Group(1, 1), 10**9) == (0.0, 0.0, 0.0)


def test_flat_all_to_all_across_nodes() -> None:
    c = ClusterSpec(nodes=2, devices_per_node=2, intra_bw=1e9, intra_lat=1e-5, inter_bw=1e8,
                    inter_lat=1e-4)
    t, b = coll.all_to_all(c, coll.Group(4, 2), 1 * MB)
    # node link: 2 ranks x 2 remote peers x 1 MB = 4 MB at 100 MB/s; latency 1 intra + 2 inter
    assert t == pytest.approx(1e-5 + 2e-4 + 4 * MB / 1e8)
    assert b == pytest.approx(3 * MB)


def test_hierarchical_all_to_all_trades_latency_for_intra_bytes() -> None:
    c = ClusterSpec(nodes=4, devices_per_node=8, intra_bw=1e11, intra_lat=1e-6, inter_bw=1e9,
                    inter_lat=1e-4)
    grp = coll.Group(32, 8)
    flat, _ = coll.all_to_all(c, grp, 1000)
    hier, _ = coll.all_to_all(c, grp, 1000, hierarchical=True)
    # flat: 7 us + 24 x 100 us; hierarchical: 7 us + 3 x 100 us; same node-link bytes
    inter = 8 * 24 * 1000 / 1e9
    assert flat == pytest.approx(7e-6 + 24e-4 + inter)
    assert hier == pytest.approx(7e-6 + 3e-4 + inter)


def test_onebit_allreduce_bytes_match_compressed_py() -> None:
    # n = 1000 on 4 ranks: padded to 1024, chunks of 256 elements = 32 bytes + 4 of scale;
    # two all_to_alls of 3 rows each, plus the 8-byte length all_gather (3 x 8 bytes).
    c = one_node(4, intra_lat=0.0, inter_lat=0.0, pack_rate=1e9)
    t, pack, b = coll.onebit_allreduce(c, coll.Group(4, 4), 1000)
    assert b == 2 * 3 * 36 + 3 * 8
    assert pack == pytest.approx(3 * 1000 / 1e9)
    wire = 2 * 3 * 36 / 1e9 + 3 * 8 / 1e9  # intra link, one node, no latency
    assert t == pytest.approx(pack + wire)


def test_onebit_segments_pipeline_hides_packing() -> None:
    n = 3 * coll.SEGMENT
    assert coll.onebit_segments(n, 2) == [coll.SEGMENT] * 3
    slow_pack = one_node(2, intra_lat=0.0, pack_rate=1e6)
    t, pack, _ = coll.onebit_allreduce(slow_pack, coll.Group(2, 2), n)
    # packing dominates every segment: the wire of segments 0 and 1 hides behind packing
    wire_seg = 2 * (coll.SEGMENT // 2 // 8 + 4) / 1e9
    assert t == pytest.approx(3 * 8 / 1e9 + pack + wire_seg)


def test_padded_length_matches_the_compressor() -> None:
    from moebit.comm.compressed import padded_length

    for n, w in [(1, 1), (7, 2), (1000, 4), (4097, 3), (0, 2)]:
        assert coll.padded_length(n, w) == padded_length(n, w)


def test_concurrent_groups_share_the_node_link() -> None:
    # 4 nodes x 8, ep 8: the 8 expert-dp groups (4 ranks, one per node) all cross each NIC
    c = ClusterSpec(nodes=4, devices_per_node=8, intra_bw=1e11, intra_lat=0.0, inter_bw=1e9,
                    inter_lat=0.0)
    edp = coll.group_of(c, 4, stride=8)
    assert (edp.per_node, edp.share) == (1, 8)
    t, _ = coll.ring_allreduce(c, edp, 4 * MB)
    assert t == pytest.approx(6 * 1 * MB / (1e9 / 8))
    assert coll.group_of(c, 32).share == 1
    shared = one_node(4, shared_link=True)
    assert coll.group_of(shared, 2).share == 2  # two ep groups of 2 on one shaped link
