"""Runtime ISA dispatch of the native kernels: every level this CPU runs gives the torch
path's results, ``MOEBIT_ISA`` forces a level, and the build picks the best by default."""

from __future__ import annotations

import pytest
import torch

from moebit.comm import _bitpack_c, _native, _rowquant_c, bitpack
from moebit.comm import all_to_all as a2a

LEVELS = ["portable", "avx2", "avx512"]
ISA_CODE = {"portable": 0, "avx2": 1, "avx512": 2}


def _level(isa: str) -> None:
    if not _native.native_enabled():
        pytest.skip("native kernels are off here (MOEBIT_NATIVE=0 or not Linux)")
    if isa not in _native.supported_isas():
        pytest.skip(f"this CPU cannot run {isa} code (runs {_native.supported_isas()})")


@pytest.fixture(params=LEVELS)
def bitpack_at(request, monkeypatch):
    """bitpack's public functions running on the library compiled for one ISA level."""
    _level(request.param)
    lib = _bitpack_c.load_isa(request.param)
    assert lib is not None and lib.mb_isa() == ISA_CODE[request.param]
    monkeypatch.setattr(_bitpack_c, "_lib", lib)
    monkeypatch.setattr(_bitpack_c, "_tried", True)
    return request.param


def _values(n: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[::17] = 0.0
    x[5::23] = -0.0
    return x


@pytest.mark.parametrize("n", [1, 31, 32, 63, 64, 65, 1000, 4099, 70001])
def test_pack_and_unpack_equal_torch_at_every_level(bitpack_at, n):
    x = _values(n)
    packed = bitpack.pack_signs(x)
    assert torch.equal(packed, bitpack._pack_torch(x))
    out = torch.empty(n)
    assert torch.equal(bitpack.unpack_scaled(packed, n, 0.5, out=out),
                       bitpack._signs_torch(packed, n) * 0.5)


@pytest.mark.parametrize("n", [7, 64, 4099, 40001])
def test_feedback_and_server_steps_equal_torch_at_every_level(bitpack_at, n):
    x, y0 = _values(n), torch.randn(n, generator=torch.Generator().manual_seed(1))
    y, out = y0.clone(), torch.empty((n + 7) // 8, dtype=torch.uint8)
    norm = bitpack.feedback_step_(x, y, 0.3, out)
    want = bitpack._feedback_torch(x, y0, 0.3)
    assert torch.equal(y, want) and torch.equal(out, bitpack._pack_torch(want))
    assert norm == pytest.approx(float(want.double().square().sum()), rel=1e-5)
    rows = torch.stack([bitpack._pack_torch(_values(n) * s) for s in (1, -1, 1)])
    z0 = torch.randn(n)
    z, out2 = z0.clone(), torch.empty_like(out)
    bitpack.server_step_(rows, [0.5, 0.25, 2.0], n, z, 0.1, out2)
    a = sum(c * bitpack._signs_torch(rows[r], n) for r, c in enumerate([0.5, 0.25, 2.0]))
    assert torch.allclose(z, bitpack._feedback_torch(a, z0, 0.1), rtol=0, atol=1e-6)
    assert torch.equal(out2, bitpack._pack_torch(z))


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("shape", [(9, 256), (4, 37), (3, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_row_codec_equals_torch_at_every_level(monkeypatch, isa, shape, dtype):
    _level(isa)
    lib = _rowquant_c.load_isa(isa)
    assert lib is not None and lib.rq_isa() == ISA_CODE[isa]
    monkeypatch.setattr(_rowquant_c, "_lib", lib)
    monkeypatch.setattr(_rowquant_c, "_tried", True)
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
         * torch.logspace(-3, 3, shape[0])[:, None]).to(dtype)
    x[1, 3] = float("nan")
    native = _rowquant_c.encode_int8(x)
    assert native is not None and torch.equal(native, a2a._encode_scaled(x, "int8"))
    d = shape[1]
    q, scale = native[:, :d].view(torch.int8), native[:, d:].contiguous().view(torch.float32)
    got = _rowquant_c.decode_int8(native, dtype, d)
    assert torch.equal(got.isnan(), torch.mul(q, scale).to(dtype).isnan())
    assert torch.equal(got.nan_to_num(), torch.mul(q, scale).to(dtype).nan_to_num())


def test_select_isa_defaults_to_the_best_and_honours_the_override(monkeypatch):
    monkeypatch.delenv("MOEBIT_ISA", raising=False)
    runnable = _native.supported_isas()
    assert runnable[0] == "portable" and _native.select_isa() == runnable[-1]
    flags = _native.cpu_flags()
    if {"avx2", "fma"} <= flags and "f16c" in flags:
        assert "avx2" in runnable
    monkeypatch.setenv("MOEBIT_ISA", "portable")
    assert _native.select_isa() == "portable"
    monkeypatch.setenv("MOEBIT_ISA", "sse9")
    with pytest.raises(ValueError, match="MOEBIT_ISA"):
        _native.select_isa()
    missing = [isa for isa in LEVELS if isa not in runnable]
    if missing:
        monkeypatch.setenv("MOEBIT_ISA", missing[-1])
        with pytest.warns(RuntimeWarning, match="runs only"):
            assert _native.select_isa() == runnable[-1]


def test_each_level_builds_its_own_library(tmp_path, monkeypatch):
    _level("portable")
    monkeypatch.setenv("MOEBIT_NATIVE_CACHE", str(tmp_path))
    for isa in _native.supported_isas():
        lib = _native.compile_library("isa_probe", "int probe(void) { return 7; }", isa=isa)
        assert lib.moebit_isa == isa and lib.probe() == 7
    built = sorted(p.name.split("_")[3] for p in tmp_path.glob("libmoebit_isa_probe_*.so"))
    assert built == sorted(_native.supported_isas())
