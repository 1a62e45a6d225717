"""Bytes per collective kind: token all-to-all, exact gradient averages, 1-bit, DiLoCo's
outer exchanges, DDP hooks."""

from moebit.comm import stats


def test_every_op_moebit_issues_has_its_kind() -> None:
    kinds = {
        "moe.all_to_all": "a2a", "moe.all_to_all.intra": "a2a", "moe.all_to_all.inter": "a2a",
        "grad_allreduce": "exact", "allreduce.dense": "exact", "ddp.allreduce": "exact",
        "onebit_adam.warmup": "exact", "zero_one_adam.var": "exact",
        "onebit.phase1": "onebit", "onebit.header": "onebit",
        "outer.fp32": "outer", "outer.bf16": "outer", "outer.int8.phase1": "outer",
        "outer.onebit.phase2": "outer", "outer.onebit.header": "outer",
        "outer_node.allgather": "outer_node",
        "ddp.powersgd": "ddp_hook", "ddp.fp16": "ddp_hook",
        "nan_check": "other", "freeze_check": "other",
        "fsdp.rs.int8": "rs", "fsdp.rs.none": "rs", "fsdp.ag.bf16": "ag",
        "fsdp.allreduce.replicate": "exact",
    }
    assert {op: stats.kind_of(op) for op in kinds} == kinds
    assert set(kinds.values()) == set(stats.KINDS)


def test_by_kind_sums_and_per_step_divides() -> None:
    snap = stats.CommStats({"moe.all_to_all": stats.OpStats(2, 100, 90, 0.5),
                            "moe.all_to_all.inter": stats.OpStats(1, 10, 10, 0.1),
                            "grad_allreduce": stats.OpStats(1, 40, 40, 0.2)})
    k = snap.by_kind()
    assert (k["a2a"].calls, k["a2a"].bytes_sent, k["a2a"].seconds) == (3, 110, 0.6)
    per = stats.per_step_by_kind(snap, 2)
    assert per["step_bytes_by_kind"] == {"a2a": 55.0, "exact": 20.0}
    assert per["comm_seconds_by_kind"]["exact"] == 0.1
