"""Impossible sharding layouts and refused optimizer combinations fail with one line
that names the key, the sizes or the reason. (The checks that need ranks run in
test_shard_grads' 4-rank start-up.)"""

from __future__ import annotations

import pytest
import torch
from shard_toys import tiny_gpt

from moebit.optim.build import optimizer_names
from moebit.training.shard_config import COMPOSES, ShardConfig, check_composition, check_layout
from moebit.training.sharding import make_meshes, shard_model


@pytest.mark.parametrize(("fields", "named"), [
    ({"shard": "zero3"}, "shard must be one of"),
    ({"shard": "fsdp", "param_dtype": "fp8"}, "param_dtype must be one of"),
    ({"shard": "fsdp", "reduce_dtype": "int8"}, "reduce_dtype must be one of"),
    ({"shard": "fsdp", "rs_compress": "fp8"}, "rs_compress must be one of"),
    ({"shard": "fsdp", "ag_compress": "int4"}, "ag_compress must be one of"),
    ({"shard": "none", "rs_compress": "int8"}, "need shard=fsdp or hsdp"),
    ({"shard": "hsdp", "local_world_size": -1}, "local_world_size must be >= 0"),
    ({"shard": "fsdp", "quant_block": 0}, "quant_block must be >= 1"),
])
def test_bad_shard_settings_are_named(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named) as e:
        ShardConfig(**fields)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
@pytest.mark.parametrize("shard", ["fsdp", "hsdp"])
def test_one_bit_optimizers_are_refused_under_sharding_in_one_line(name: str, shard: str) -> None:
    with pytest.raises(ValueError) as e:
        check_composition(name, shard)
    msg = str(e.value)
    assert "\n" not in msg and repr(name) in msg and f"shard={shard}" in msg
    assert "replicated" in msg and "rs_compress=int8" in msg  # the reason and the way out
    check_composition(name, "none")  # unsharded, they run as always


def test_every_registered_optimizer_is_classified() -> None:
    for name in optimizer_names():
        try:
            check_composition(name, "fsdp")
        except ValueError as e:
            assert "does not compose" in str(e), name  # refused for a stated reason
        else:
            assert name in COMPOSES
    with pytest.raises(ValueError, match="'sgd' is not known to compose with shard=fsdp"):
        check_composition("sgd", "fsdp")
    with pytest.raises(ValueError, match="shard must be one of"):
        check_composition("adam", "zero")


def test_sharding_needs_a_process_group_and_decoder_blocks() -> None:
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        make_meshes(ShardConfig("fsdp"))
    with pytest.raises(ValueError, match="Linear has no .blocks ModuleList"):
        shard_model(torch.nn.Linear(2, 2), ShardConfig("fsdp"))
    model = tiny_gpt()
    assert shard_model(model, ShardConfig("none")) is model  # none: untouched


@pytest.mark.parametrize(("cfg", "world", "ep", "local", "named"), [
    (ShardConfig("fsdp"), 4, 3, None, "ep_size=3 does not divide the world size 4"),
    (ShardConfig("hsdp", local_world_size=8), 8, 1, None, "hsdp needs more than one node"),
    (ShardConfig("hsdp", local_world_size=3), 8, 1, None,
     "hsdp: the node size LOCAL_WORLD_SIZE=3 does not divide the world size 8"),
    (ShardConfig("hsdp", local_world_size=2), 8, 4, None,
     "hsdp: ep_size=4 must divide the node size 2"),
    (ShardConfig("fsdp"), 8, 2, 2, "2 local experts .* do not split over the 4 "
                                   "expert-data-parallel ranks"),
    (ShardConfig("none"), 8, 1, None, "shard is none"),
])
def test_check_layout_names_impossible_layouts_before_any_rank_starts(cfg, world, ep, local,
                                                                      named) -> None:
    with pytest.raises(ValueError, match=named) as e:
        check_layout(cfg, world, ep, local)
    assert "\n" not in str(e.value)


def test_check_layout_sizes_hsdp_with_experts() -> None:
    lay = check_layout(ShardConfig("hsdp", local_world_size=4), 16, ep_size=2, local_experts=4)
    assert (lay.nodes, lay.node, lay.efsdp) == (4, 4, 2)
    assert check_layout(ShardConfig("fsdp"), 8, ep_size=2, local_experts=8).efsdp == 4


def test_shard_config_round_trips_flat_keys_and_names_unknown_ones() -> None:
    cfg = ShardConfig(shard="hsdp", param_dtype="bf16", rs_compress="int8", local_world_size=8)
    assert ShardConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown sharding key 'rs_compression'; known: shard,"):
        ShardConfig.from_dict({"shard": "fsdp", "rs_compression": "int8"})
