"""`moebit plan`'s outer rows: bytes per sync as moebit sends them, streaming's peak, the
overlap of a delayed exchange, the node-link share, the CLI table and its errors."""

from __future__ import annotations

import json

import pytest

from moebit.cli.plan import main
from moebit.plan import collectives as coll
from moebit.plan.cluster import ClusterSpec
from moebit.plan.model import Setup, predict
from moebit.plan.outer import OuterSetup, compare_all, exchange_cost, predict_outer
from moebit.plan.spec import ModelSpec, SpecError

TINY = ModelSpec("tiny", 2, 64, 4, 256, 256, 32, learned_positions=32)
TWO_BY_TWO = ClusterSpec(nodes=2, devices_per_node=2, intra_bw=10e9, intra_lat=0.0,
                         inter_bw=100e6 / 8, inter_lat=1e-4, flops=1e10, pack_rate=1e9,
                         update_rate=1e9)


def test_bytes_per_sync_are_what_the_outer_exchange_records():
    """The figures tests/optim/test_outer_ranks.py measures for one sync of 385 elements on
    2 ranks: fp32 4n, bf16 2n, int8 two phases of half of (512 padded + 2 scales x 4)."""
    grp = coll.Group(2, 1)
    c = TWO_BY_TWO
    assert exchange_cost(c, grp, 385, "none")[1] == 4 * 385
    assert exchange_cost(c, grp, 385, "bf16")[1] == 2 * 385
    assert exchange_cost(c, grp, 385, "int8")[1] == 2 * (512 + 4 * 2) // 2
    # 1 bit: the 8-byte length gather, then two all-to-alls of 400/2/8 signs + a scale
    assert exchange_cost(c, grp, 385, "1bit", onebit_block=0)[1] == 8 + 2 * (400 // 2 // 8 + 4)
    # one scale per 256: 385 over 2 ranks in whole blocks is 256 a rank, 32 B of signs + 4
    assert exchange_cost(c, grp, 385, "1bit")[1] == 2 * (256 // 8 + 4)
    assert exchange_cost(c, coll.Group(1, 1), 385, "none") == (0.0, 0.0)


def test_streaming_peak_is_one_fragment_and_the_average_is_diloco_s():
    s = Setup(micro_batch=2, steps=200)
    d = predict_outer(TINY, TWO_BY_TWO, s, "diloco", OuterSetup(every=40))["outer"]
    st = predict_outer(TINY, TWO_BY_TWO, s, "streaming_diloco",
                       OuterSetup(every=40, fragments=4))["outer"]
    assert st["fragments"] == 4 and d["fragments"] == 1
    assert st["peak_bytes_per_step"] <= d["peak_bytes_per_step"] / 4 * 1.001
    assert st["bytes_per_step"] == pytest.approx(d["bytes_per_step"], rel=1e-3)
    assert d["syncs"] == 5 and st["syncs"] == 20


def test_a_delayed_exchange_hides_behind_inner_steps():
    s = Setup(micro_batch=2, steps=100)
    rows = {d: predict_outer(TINY, TWO_BY_TWO, s, "streaming_diloco",
                             OuterSetup(every=40, fragments=4, delay=d)) for d in (0, 1, 9)}
    inner = rows[0]["step_s_by_kind"]["exact"]
    for d, r in rows.items():
        o = r["outer"]
        assert o["hidden_s"] == pytest.approx(min(o["sync_s"], d * inner))
        assert r["step_s"] == pytest.approx(inner + 4 * (o["sync_s"] - o["hidden_s"]) / 40)
    assert rows[0]["outer"]["hidden_s"] == 0.0
    assert rows[9]["outer"]["outer_share"] < rows[1]["outer"]["outer_share"] < rows[0]["outer"]["outer_share"]


def test_node_link_bytes_and_share_follow_the_topology_and_the_link():
    s = Setup(micro_batch=2, steps=100)
    o = OuterSetup(every=10, compress="int8")
    two = predict_outer(TINY, TWO_BY_TWO, s, "diloco", o)
    tokens = 2 * 32 * 4
    assert two["outer"]["outer_group_size"] == 2  # the same local rank on each node
    assert two["outer"]["inter_node_bytes_per_token"] == pytest.approx(
        4 * two["outer"]["bytes_per_step"] / tokens)
    one = predict_outer(TINY, TWO_BY_TWO.with_(nodes=1), s, "diloco", o)
    assert one["outer"]["inter_node_bytes_per_token"] == 0.0 and one["outer"]["sync_s"] == 0.0
    fast = predict_outer(TINY, TWO_BY_TWO.with_(inter_bw=10e9 / 8), s, "diloco", o)
    assert fast["outer"]["outer_share"] < two["outer"]["outer_share"]
    world = predict_outer(TINY, TWO_BY_TWO, s, "diloco", OuterSetup(every=10, group="world"))
    assert world["outer"]["outer_group_size"] == 4 and world["bytes_per_step"]["exact"] == 0.0
    # every compression sends fewer bytes than the one before it; all far below Adam's
    rows = compare_all(TINY, TWO_BY_TWO, s, ["adam", "diloco"], o, ["none", "bf16", "int8", "1bit"])
    per_sync = [r["outer"]["bytes_per_sync"] for r in rows[1:]]
    assert per_sync == sorted(per_sync, reverse=True) and len(set(per_sync)) == 4
    adam = predict(TINY, TWO_BY_TWO, s, "adam")
    assert rows[0]["bytes_sent"] == adam["bytes_sent"]
    assert all(r["outer"]["bytes_per_step"] < adam["bytes_per_step"]["exact"] / 10 for r in rows[1:])


def test_the_plan_prints_the_outer_table(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--model", "bert-large", "--nodes", "2", "--devices-per-node", "2",
                 "--inter-bw", "100mbit", "--optimizers", "adam,diloco,streaming_diloco",
                 "--outer-compress", "none,1bit", "--outer-every", "50",
                 "--outer-fragments", "5", "--outer-delay", "2", "--steps", "500",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "outer sync" in text and "share of step" in text and "node-link B/token" in text
    for row in ("diloco(none)", "diloco(1bit)", "streaming_diloco(none)", "streaming_diloco(1bit)"):
        assert row in text
    res = json.loads(out.read_text())["results"]
    assert [r["optimizer"] for r in res] == ["adam", "diloco(none)", "diloco(1bit)",
                                             "streaming_diloco(none)", "streaming_diloco(1bit)"]
    assert res[3]["outer"]["fragments"] == 5 and res[3]["outer"]["delay"] == 2


@pytest.mark.parametrize("flags, message", [
    (["--outer-every", "0"], "setup.outer_every: must be a positive integer (got 0)"),
    (["--outer-compress", "2bit"], "setup.outer_compress: '2bit' is not one of"),
    (["--outer-fragments", "20", "--outer-every", "10"], "setup.outer_fragments: 20 fragments"),
    (["--outer-fragments", "2", "--outer-every", "10", "--outer-delay", "5"],
     "setup.outer_delay: must be >= 0 and < outer_every / fragments = 5"),
    (["--ep-size", "4"], "setup.ep_size: 4 does not divide"),
])
def test_bad_outer_settings_are_one_line_errors(flags, message, capsys):
    argv = ["--model", "gpt-350m-moe128", "--nodes", "2", "--devices-per-node", "2",
            "--optimizers", "streaming_diloco", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moebit plan: error: ") and message in err and "\n" not in err
    with pytest.raises(SpecError, match="outer_group"):
        OuterSetup(group="rack").check("diloco")


def test_a_node_sends_its_dense_model_once_whether_sharded_or_split():
    """``--outer-shard fsdp``: a rank holds 1/g of the parameters (dense and experts, with
    ep inside the node), so its sync sends 1/g of the bytes. Replicated, the node's g ranks
    split each exchange (1/g each, then an all-gather inside the node): the same bytes over
    the slow link, a longer sync. The inner exchange becomes FSDP2's gathers and
    reduce-scatter (1.5x an allreduce's bytes)."""
    s = Setup(micro_batch=2, steps=100, seq_len=32)
    four = ClusterSpec(nodes=2, devices_per_node=4, intra_bw=10e9, intra_lat=0.0,
                       inter_bw=100e6 / 8, inter_lat=1e-4, flops=1e10, pack_rate=1e9,
                       update_rate=1e9)
    rep = predict_outer(TINY, four, s, "diloco", OuterSetup(every=10))
    fsdp = predict_outer(TINY, four, s, "diloco", OuterSetup(every=10, shard="fsdp"))
    n = TINY.total_params()
    assert rep["outer"]["held_params_per_rank"] == n and fsdp["outer"]["shard"] == "fsdp"
    assert fsdp["outer"]["held_params_per_rank"] == -(-n // 4)
    assert fsdp["outer"]["bytes_per_sync"] == pytest.approx(rep["outer"]["bytes_per_sync"],
                                                            rel=1e-3)
    assert fsdp["outer"]["inter_node_bytes_per_token"] == pytest.approx(
        rep["outer"]["inter_node_bytes_per_token"], rel=1e-3)
    assert rep["outer"]["sync_s"] > fsdp["outer"]["sync_s"]  # the all-gather inside the node
    whole = predict_outer(TINY, four, s, "diloco", OuterSetup(every=10, group="world"))
    assert whole["outer"]["held_params_per_rank"] == n
    assert fsdp["bytes_per_step"]["exact"] == pytest.approx(
        1.5 * rep["bytes_per_step"]["exact"], rel=1e-3)
    from moebit.plan.presets import preset

    moe = preset("gpt-350m-moe128")  # ep 2 inside a node of 4: efsdp groups of 2
    m = predict_outer(moe, four, Setup(micro_batch=2, steps=100, ep_size=2), "diloco",
                      OuterSetup(every=10, shard="fsdp"))
    assert m["outer"]["held_params_per_rank"] == pytest.approx(moe.total_params() / 4, rel=1e-3)
    with pytest.raises(SpecError, match="outer_shard: fsdp shards inside a node"):
        OuterSetup(group="world", shard="fsdp").check("diloco")
    with pytest.raises(SpecError, match="outer_shard: 'hsdp' is not none or fsdp"):
        OuterSetup(shard="hsdp").check("diloco")
