"""``moebit bench kernels`` end to end at toy sizes: every ISA level and kernel reports."""

from __future__ import annotations

import json

import pytest

from moebit.bench import kernels as bench_kernels
from moebit.comm import _native


def test_bench_kernels_reports_every_level_and_kernel(tmp_path, capsys):
    if not _native.native_enabled():
        pytest.skip("native kernels are off here")
    out = tmp_path / "k.json"
    assert bench_kernels.main(["--rows", "1,3", "--n", "64", "--k", "96", "--reps", "1",
                               "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["isas"] == _native.supported_isas()
    packs = {(r["kernel"], r["isa"], r["n"]) for r in data["results"] if r["bench"] == "sign_pack"}
    assert packs == {(k, isa, n) for k in ("pack", "worker") for isa in data["isas"]
                     for n in (1 << 16, 1 << 24)}
    gemv = [r for r in data["results"] if r["bench"] == "gemv"]
    names = {r["kernel"] for r in gemv}
    assert {"torch fp32 mm", "torch int8pack_mm (bf16 x)"} <= names
    assert {f"native int4 g32 {isa}" for isa in data["isas"]} <= names
    assert {r["rows"] for r in gemv} == {1, 3}
    assert all(r["gb_s_wall"] > 0 and r["ms_wall"] > 0 for r in gemv)
    assert "gemv rows=3" in capsys.readouterr().out


def test_bench_kernels_rejects_bad_rows():
    with pytest.raises(SystemExit):
        bench_kernels.main(["--rows", "1,x"])
