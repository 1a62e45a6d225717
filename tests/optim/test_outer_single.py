"""DiLoCo's outer optimizer in one process: settings errors, the fragment schedule, the int8
quantizer, the stats kind, and state round trips (the multi-rank behaviour is in
test_outer_ranks.py and test_outer_groups.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moebit.comm import stats
from moebit.comm.quantize import Int8Allreduce, dequantize_blocks, quantize_blocks
from moebit.optim import (
    OuterOptimizer,
    ZeroOneAdam,
    build_optimizer,
    build_outer_optimizer,
    module_blocks,
)

from toys import flat_params, regression_batch, regression_mlp


def _setup(**kw):
    model = regression_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw.setdefault("every", 4)
    return model, opt, OuterOptimizer(opt, [model[0], model[2]], **kw)


@pytest.mark.parametrize("kw,key", [
    ({"every": 0}, "outer_every"),
    ({"every": 4, "fragments": 3}, "outer_fragments 3: more fragments than the 2 blocks"),
    ({"every": 1, "fragments": 2}, "outer_fragments 2: at most outer_every=1"),
    ({"every": 4, "fragments": 2, "delay": 2}, "outer_delay 2: must be below outer_every/outer_fragments"),
    ({"every": 4, "delay": -1}, "outer_delay"),
    ({"every": 4, "compress": "fp8"}, "outer_compress 'fp8'"),
    ({"every": 4, "alpha": 1.0}, "outer_alpha"),
    ({"every": 4, "momentum": 1.0}, "outer_momentum"),
    ({"every": 4, "lr": 0.0}, "outer_lr"),
    ({"every": 4, "nesterov": "yes"}, "outer_nesterov"),
])
def test_bad_settings_give_one_line_errors_naming_the_key(kw, key):
    with pytest.raises(ValueError, match=key) as e:
        _setup(**kw)
    assert "\n" not in str(e.value)


def test_what_cannot_be_wrapped_is_refused():
    model = regression_mlp()
    with pytest.raises(TypeError, match="inner optimizer must be a torch.optim.Optimizer"):
        OuterOptimizer(object(), model.parameters(), every=2)  # type: ignore[arg-type]
    half = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="2 parameter\\(s\\) of the blocks are not trained"):
        OuterOptimizer(half, model.parameters(), every=2)
    full = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="trains 2 parameter\\(s\\) that no block holds"):
        OuterOptimizer(full, [model[0]], every=2)


def test_build_outer_optimizer_takes_flat_keys():
    model = regression_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = build_outer_optimizer(opt, model.parameters(), None, outer_every=8,
                                  outer_compress="int8", outer_fragments=4, outer_delay=1)
    assert (outer.every, outer.compress, outer.fragments, outer.delay) == (8, "int8", 4, 1)
    with pytest.raises(ValueError, match="unknown outer optimizer key\\(s\\) outer_evry"):
        build_outer_optimizer(opt, model.parameters(), None, outer_evry=8)
    with pytest.raises(ValueError, match="outer_every"):
        build_outer_optimizer(opt, model.parameters(), None)


def test_module_blocks_keep_tied_parameters_once_and_skip_frozen():
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight  # tied
    frozen = nn.Linear(3, 3)
    frozen.requires_grad_(False)
    blocks = module_blocks([emb, frozen, nn.Linear(3, 3), head])
    assert [len(b) for b in blocks] == [1, 2]  # the frozen block and the tied head vanish


def test_fragments_start_staggered_by_h_over_f():
    _, _, outer = _setup(every=8, fragments=2)
    starts = {t: outer.fragment_starting_at(t) for t in range(1, 25)}
    assert {t: i for t, i in starts.items() if i is not None} == {8: 0, 12: 1, 16: 0, 20: 1, 24: 0}


def _run(model, opt, outer, steps):
    records = []
    for t in steps:
        x, y = regression_batch(0, t)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        rec = outer.step()
        if rec is not None:
            records.append(rec)
    return records


def test_one_worker_with_lr_1_and_no_momentum_is_the_inner_run():
    """A single worker's average is its own pseudo-gradient: lr 1, momentum 0 lands exactly
    on the inner parameters, so the run is the inner optimizer's alone."""
    model, opt, outer = _setup(lr=1.0, momentum=0.0)
    ref = regression_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    records = _run(model, opt, outer, range(12))
    for t in range(12):
        x, y = regression_batch(0, t)
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
    assert [r.step for r in records] == [4, 8, 12]
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=1e-6)


@pytest.mark.parametrize("compress,fragments,delay,alpha,cut", [
    ("1bit", 1, 0, 0.0, "blocks"), ("int8", 2, 1, 0.5, "blocks"), ("bf16", 2, 1, 0.0, "blocks"),
    ("1bit", 2, 1, 0.5, "even")])
def test_state_round_trip_continues_bit_exactly(compress, fragments, delay, alpha, cut):
    kw = dict(compress=compress, fragments=fragments, delay=delay, alpha=alpha, cut=cut)
    model, opt, outer = _setup(every=6, **kw)
    _run(model, opt, outer, range(20))
    straight, straight_syncs = flat_params(model), outer.sync_count
    model, opt, outer = _setup(every=6, **kw)
    _run(model, opt, outer, range(9 if delay else 10))  # fragment 1 in flight at 9
    assert outer.in_flight == bool(delay)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": opt.state_dict(), "outer": outer.state_dict()}
    model2, opt2, outer2 = _setup(every=6, **kw)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    outer2.load_state_dict(saved["outer"])
    _run(model2, opt2, outer2, range(9 if delay else 10, 20))
    assert torch.equal(flat_params(model2), straight)
    assert outer2.sync_count == straight_syncs and outer2.step_count == 20


def test_load_refuses_another_schedule_naming_the_key():
    _, _, outer = _setup(every=4)
    _, _, other = _setup(every=5)
    with pytest.raises(ValueError, match="outer_every=4, this run 5"):
        other.load_state_dict(outer.state_dict())
    with pytest.raises(ValueError, match="no 'outer' section"):
        other.load_state_dict({})


def test_sync_records_carry_norms_time_and_the_outer_kind():
    model, opt, outer = _setup(every=2, compress="1bit")
    records = _run(model, opt, outer, range(4))
    assert [r.step for r in records] == [2, 4]
    m = records[0].as_metrics()
    assert m["outer_pseudo_grad_norm"] > 0 and m["outer_seconds"] > 0
    assert outer.state_bytes() >= 2 * 4 * sum(p.numel() for p in model.parameters())
    assert stats.kind_of("outer.onebit.phase1") == "outer"
    assert stats.kind_of("outer.int8.phase2") == "outer" and stats.kind_of("outer.fp32") == "outer"
    assert stats.kind_of("onebit.phase1") == "onebit"  # the inner optimizer's stays apart


@pytest.mark.parametrize("name", ["onebit_adam", "lamb"])
def test_moebit_inner_optimizers_can_be_wrapped(name):
    model = regression_mlp()
    start = flat_params(model)
    opt = build_optimizer(name, model.parameters(), lr=1e-2, freeze_step=2)
    outer = OuterOptimizer(opt, model.parameters(), every=3, compress="int8")
    records = _run(model, opt, outer, range(7))
    assert [r.step for r in records] == [3, 6]
    assert getattr(opt, "frozen_at", 2) == 2 and not torch.equal(flat_params(model), start)


def test_int8_blocks_round_to_within_half_a_step():
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    x[256:512] *= 100  # one block of much larger values keeps its own scale
    q, s = quantize_blocks(x, 256)
    assert q.dtype == torch.int8 and s.shape == (4,)
    err = (dequantize_blocks(q, s, 256) - x).view(4, 256).abs().amax(1)
    assert torch.all(err <= x.view(4, 256).abs().amax(1) / 254 * 1.0001)
    assert torch.equal(quantize_blocks(torch.zeros(256))[1], torch.ones(1))  # no 0 scale
    with pytest.raises(ValueError, match="multiple of block=256"):
        quantize_blocks(torch.zeros(100), 256)
    avg = Int8Allreduce(None, block=64).allreduce(x[:1000])  # world 1: two roundings
    assert avg.shape == (1000,)
    torch.testing.assert_close(avg, x[:1000], rtol=0, atol=float(x.abs().max()) / 100)


def test_zero_one_adam_restarts_its_local_steps_from_the_outer_point():
    """0/1 Adam measures its local progress from an anchor: after the outer step moved the
    parameters, the anchor must be the new point, or the next sync counts the jump as
    progress (and folds it into the momentum)."""
    model = regression_mlp()
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=2, local_step_scaler=100,
                      local_step_clipper=8)
    outer = OuterOptimizer(opt, model.parameters(), every=5, lr=0.7)
    records = _run(model, opt, outer, range(5))
    assert [r.step for r in records] == [5] and opt.frozen_at == 2 and opt.since_sync == 0
    for p in model.parameters():
        assert torch.equal(opt.state[p]["anchor"], p.detach())


def test_int8_block_setting_is_checked_under_its_key():
    with pytest.raises(ValueError, match="outer_int8_block"):
        _setup(compress="int8", int8_block=0)
    with pytest.raises(ValueError, match="invalid outer_onebit_block 12: elements per 1-bit"):
        _setup(compress="1bit", onebit_block=12)


def test_fragments_balance_elements_not_block_counts():
    """A sync's peak is its largest fragment: the cut minimizes it (an embedding block next
    to four equal decoder blocks must not double a fragment), every fragment non-empty."""
    from moebit.optim.outer_params import balanced_bounds, split_fragments

    assert balanced_bounds([33, 197, 197, 197, 197, 1], 4) == [0, 2, 3, 4, 6]
    assert balanced_bounds([1] * 5, 5) == [0, 1, 2, 3, 4, 5]
    assert balanced_bounds([5, 1, 1, 1], 2) == [0, 1, 4]  # block counts would give [0, 2, 4]
    blocks = [[torch.zeros(n)] for n in (40, 200, 200, 200, 200, 1)]
    parts = split_fragments(blocks, 4)
    sizes = [sum(pc.hi - pc.lo for pc in f) for f in parts]
    assert sizes == [240, 200, 200, 201] and max(sizes) <= 1.2 * sum(sizes) / 4


def test_even_fragments_cover_every_element_once_in_equal_runs():
    from moebit.optim.outer_params import BLOCK_ALIGN, split_fragments

    blocks = [[torch.zeros(n)] for n in (4000, 20000, 20000, 20000, 20000, 100)]
    parts = split_fragments(blocks, 4, cut="even")
    sizes = [sum(pc.hi - pc.lo for pc in f) for f in parts]
    total = sum(sizes)
    assert total == 84100 and max(sizes) - total / 4 <= BLOCK_ALIGN / 2
    seen = {id(b[0]): torch.zeros(b[0].numel(), dtype=torch.int64) for b in blocks}
    for f in parts:
        for pc in f:
            seen[id(pc.param)][pc.lo:pc.hi] += 1
    assert all(bool((c == 1).all()) for c in seen.values())
    assert len(split_fragments(blocks, 7, cut="even")) == 7  # more fragments than blocks
    with pytest.raises(ValueError, match="outer_fragments 400: 84100 elements cannot make"):
        split_fragments(blocks, 400, cut="even")
    with pytest.raises(ValueError, match="invalid outer_fragment_cut 'layers'"):
        _setup(cut="layers")


def test_an_even_fragment_syncs_exactly_its_elements():
    """lr 0.5, momentum 0, one worker: a sync moves its fragment's elements halfway back to
    theta_sync and leaves every other element where the inner steps put it."""
    model, opt, outer = _setup(every=4, fragments=2, cut="even", lr=0.5, momentum=0.0)
    start = flat_params(model)
    _run(model, opt, outer, range(3))
    before = flat_params(model)
    x, y = regression_batch(0, 3)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    local = flat_params(model)
    assert outer.step() is not None  # fragment 0 (offset 0) syncs at step 4
    after = flat_params(model)
    n0 = sum(pc.hi - pc.lo for pc in outer._frags[0].pieces)
    torch.testing.assert_close(after[:n0], (start[:n0] + local[:n0]) / 2, rtol=0, atol=1e-7)
    assert torch.equal(after[n0:], local[n0:]) and not torch.equal(before, local)
