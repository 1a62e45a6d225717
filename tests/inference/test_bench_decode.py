"""``moebit bench decode``: the bandwidth floor's arithmetic against a hand count, the
floor's formats against the bytes ``quantize_experts_`` really stores, and the command on
the tiny configuration (JSON rows, floors, agreement with transformers)."""

from __future__ import annotations

import json

import pytest
import torch

from moebit.bench import decode_floor as fl

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256)


def test_floor_by_hand():
    dims = fl.Dims.of_config(TINY)
    assert (dims.head_dim, dims.kv_heads, dims.tied) == (16, 2, False)
    f32 = fl.weight_bytes(dims, fl.SCHEMES["moebit_fp32"])
    # q 64x64, k and v 32x64, o 64x64 floats, two layers
    assert f32["attention"] == 2 * 4 * (64 * 64 + 2 * 32 * 64 + 64 * 64) == 98304
    assert f32["norms"] == 4 * 64 * 5  # two per layer and the final one
    assert f32["router"] == 2 * 4 * 4 * 64
    assert f32["experts"] == 2 * 2 * 4 * 3 * 64 * 96  # 2 layers x top-2 x (gate, up, down)
    assert (f32["embedding_row"], f32["head"]) == (4 * 64, 4 * 256 * 64)
    assert f32["total"] == 462336
    int4 = fl.weight_bytes(dims, fl.SCHEMES["moebit_int4"])
    # gate/up [96, 64]: 2 groups a row of 16 bytes + a 4-byte scale; down [64, 96]: 3 groups
    assert int4["experts"] == 2 * 2 * (2 * 96 * 2 * 20 + 64 * 3 * 20) == 46080
    assert int4["attention"] == f32["attention"]  # only the experts are quantized
    int8 = fl.weight_bytes(dims, fl.SCHEMES["moebit_int8"])
    assert int8["experts"] == 2 * 2 * (2 * (96 * 64 + 4 * 96) + 64 * 96 + 4 * 64)
    q8 = fl.weight_bytes(dims, fl.SCHEMES["llamacpp_q8_0"])
    assert q8["attention"] == 2 * 34 * (64 * 2 + 2 * 32 * 2 + 64 * 2)  # 34-byte blocks of 32
    assert q8["router"] == f32["router"]  # llama.cpp keeps ffn_gate_inp in F32
    q4 = fl.weight_bytes(dims, fl.SCHEMES["llamacpp_q4_0"])
    assert q4["head"] == 256 * 2 * 18
    assert fl.floor_ms(2 * 10**9, 20.0) == pytest.approx(100.0)
    assert fl.kv_bytes(dims, 10) == 2 * 2 * 2 * 16 * 10 * 4
    with pytest.raises(ValueError, match="num_local_experts"):
        fl.Dims.of_config({k: v for k, v in TINY.items() if k != "num_local_experts"})
    with pytest.raises(ValueError, match="unknown weight format 'q5'"):
        fl.matrix_bytes("q5", 1, 1)


@pytest.mark.parametrize("bits", [8, 4])
def test_floor_formats_match_quantized_experts(bits):
    """The floor's int8 / int4 bytes per expert are what QuantExperts stores."""
    from moebit.inference.quantize import QuantExperts
    from moebit.moe.experts import Experts

    ex = Experts(4, 64, 96, expert_type="swiglu")
    q = QuantExperts(ex, bits=bits)
    fmt = "int8c" if bits == 8 else "int4g32"
    per = 2 * fl.matrix_bytes(fmt, 96, 64) + fl.matrix_bytes(fmt, 64, 96)
    assert q.weight_bytes() == 4 * per


def test_read_bandwidth_runs():
    bw = fl.read_bandwidth(1, mbytes=64, reps=2)
    assert bw["best_gb_s"] >= bw["median_gb_s"] > 0
    with pytest.raises(ValueError, match=">= 64 MB"):
        fl.read_bandwidth(1, mbytes=8)


@pytest.mark.timeout(900)  # a hang guard: seconds on a quiet host, minutes at load 30
def test_bench_decode_tiny(tmp_path):
    pytest.importorskip("transformers")
    from moebit.bench import decode

    out = tmp_path / "d.json"
    threads = torch.get_num_threads()
    try:
        assert decode.main(["--configs", "tiny", "--batch", "1", "2", "--prompt", "8",
                            "--new-tokens", "4", "--reps", "1", "--threads", "1",
                            "--bandwidth-mb", "64", "--modules", "--kv-cache", "float16",
                            "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert res["bandwidth"]["best_gb_s"] > 0 and res["isa"]
    # a probe before the run and one after the config; floors at the fastest of them
    assert len(res["bandwidth_probes_gb_s"]) == 2
    assert res["floor_gb_s"] == max(*res["bandwidth_probes_gb_s"], res["rows_best_gb_s"])
    assert min(r["x_floor"] for r in res["configs"]["tiny"]["b1"].values()) >= 0.99
    tiny = res["configs"]["tiny"]
    # a float16 cache: 2 layers x 2 kv heads x head 16 x 12 positions x 2 (k, v) x 2 bytes
    assert tiny["kv_mb_at_end"] == round(2 * 2 * 16 * 12 * 2 * 2 / 1e6, 2)
    fp32 = tiny["floors"]["moebit_fp32"]
    assert fp32["floor_ms"] == pytest.approx(1e3 * fp32["weight_bytes"] / (res["floor_gb_s"] * 1e9),
                                             abs=1e-3)
    assert tiny["b1"]["moebit_fp32"]["floor_ms"] == fp32["floor_ms"]
    assert tiny["floors"]["moebit_fp32"]["weight_bytes"] == 462336  # the hand count above
    b1, b2 = tiny["b1"], tiny["b2"]
    variants = {"moebit_fp32", "moebit_int8", "moebit_int4", "moebit_int8_all", "moebit_int4_all"}
    # --modules: each variant again, decoded through the torch modules (same floor)
    assert set(b1) == {"transformers", *variants, *(v + "_modules" for v in variants)}
    # 8-bit activation blocks of 32 do not fit tiny's head_dim of 16: named, not timed
    assert "head_dim" in tiny["skipped"]["moebit_int4_all_a8"]
    assert "head_dim" in tiny["skipped"]["moebit_int8_all_a8"]
    assert b1["moebit_int8_modules"]["floor_ms"] == b1["moebit_int8"]["floor_ms"]
    # float32 both ways: the native step's greedy text is the modules'
    assert b1["moebit_fp32_modules"]["agree_with_moebit_fp32"]["prefix"] == 4
    for name, row in b1.items():
        assert row["ms_per_step"] > 0 and row["x_floor"] > 0, name
    assert "x_floor" not in b2["moebit_int8"]  # the floor is one token's
    assert b2["moebit_int4"]["tokens_per_s"] > 0
    # same weights, float32: transformers' first greedy token is moebit's
    assert b1["transformers"]["agree_with_moebit_fp32"]["first_token"]
    assert b1["moebit_fp32"]["speedup_vs_transformers"] > 0
