"""The native one-call decode step (``moebit.inference.fused_decode``) against the module
path it replaces: logits of single steps, greedy tokens over whole generations (left
padding, rows that finish early, float32 / int8 / int4 weights, Mixtral and Qwen3-MoE
shapes), every ISA level this CPU runs, and the cases it must leave to the modules."""

from __future__ import annotations

import pytest
import torch

from moebit.comm._native import supported_isas
from moebit.inference import fused_decode
from moebit.inference.generate import generate_tokens
from moebit.inference.quantize_dense import quantize_model_
from moebit.inference.sampling import SamplingParams
from moebit.models.hf.config import HFDecoderConfig
from moebit.models.hf.decoder import HFDecoder
from moebit.models.tokenizer import ByteTokenizer
from moebit.serve.engine import Engine, Request
from moebit.serve.ragged import RaggedView
from moebit.serve.slot_cache import SlotKVCache

if fused_decode._fused_c.load() is None:
    pytest.skip("the native build is unavailable here (no C compiler?)", allow_module_level=True)

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)
FAMILIES = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # per-head q/k norms, softmax over all experts without renormalising the top 2
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=96, norm_topk_prob=False, head_dim=16),
}


def make(family: str = "mixtral", bits: int | None = None, seed: int = 0, **over) -> HFDecoder:
    torch.manual_seed(seed)
    m = HFDecoder(HFDecoderConfig.from_hf({**BASE, **FAMILIES[family], **over})).eval()
    with torch.no_grad():  # routers and norms off their init values: real choices
        for name, p in m.named_parameters():
            if name.endswith(("router.weight", "norm.weight", "layernorm.weight")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    if bits:
        quantize_model_(m, bits)
    return m


def prompts(b: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(b)
    return [torch.randint(0, 96, (5 + 3 * i,), generator=g).tolist() for i in range(b)]


def two_steps(m: HFDecoder, ps: list[list[int]]) -> torch.Tensor:
    """Prefill (the module path) then two one-token steps; both steps' logits [B, 2, V]."""
    tmax = max(map(len, ps))
    cache = m.new_cache(len(ps), tmax + 4, starts=[tmax - len(p) for p in ps])
    ids = torch.zeros(len(ps), tmax, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, tmax - len(p):] = torch.tensor(p)
    nxt = torch.tensor([[p[-1]] for p in ps])
    with torch.no_grad():
        m(ids, cache=cache, logits_to_keep=1)
        return torch.cat([m(nxt, cache=cache).logits, m(nxt + 1, cache=cache).logits], 1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_step_logits_equal_the_module_path(family: str, bits: int | None) -> None:
    m = make(family, bits)
    for b in (1, 3):  # 3: left-padded rows of different lengths
        fused_decode.detach(m)
        ref = two_steps(m, prompts(b))
        assert fused_decode.attach(m) is not None, m.decode_step_reason
        got = two_steps(m, prompts(b))
        # float32: the same sums in another order; quantized: the modules may take torch's
        # int8 kernel (bf16 activations) where the native GEMV runs here
        tol = 1e-5 if bits is None else 3e-3
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", supported_isas())
def test_every_isa_level_gives_the_same_greedy_text(isa: str) -> None:
    m = make("mixtral", 4)
    ps = prompts(3)
    fused_decode.detach(m)
    ref = generate_tokens(m, ps, max_new_tokens=10, temperature=0, batch_size=3, eos=[])
    assert fused_decode.attach(m, isa=isa) is not None
    got = generate_tokens(m, ps, max_new_tokens=10, temperature=0, batch_size=3, eos=[])
    assert got.tokens == ref.tokens


def test_rows_that_finish_early_keep_their_text() -> None:
    """An EOS ends row 0 after its first token while the others go on: the step skips
    the finished row's experts, and the live rows' text is the module path's."""
    m = make("mixtral")
    ps = prompts(3)
    fused_decode.detach(m)
    first = generate_tokens(m, ps, max_new_tokens=1, temperature=0, batch_size=3, eos=[])
    eos = [first.tokens[0][0]]
    ref = generate_tokens(m, ps, max_new_tokens=12, temperature=0, batch_size=3, eos=eos)
    fused_decode.attach(m)
    got = generate_tokens(m, ps, max_new_tokens=12, temperature=0, batch_size=3, eos=eos)
    assert got.tokens == ref.tokens and got.finish_reasons == ref.finish_reasons
    assert got.finish_reasons[0] == "stop"


def test_generate_attaches_by_itself_and_detach_sticks() -> None:
    m = make("mixtral", 8)
    generate_tokens(m, prompts(1), max_new_tokens=3, temperature=0, eos=[])
    assert isinstance(m.decode_step, fused_decode.FusedDecode)
    fused_decode.detach(m)
    generate_tokens(m, prompts(1), max_new_tokens=3, temperature=0, eos=[])
    assert m.decode_step is None and "detach" in m.decode_step_reason


def test_quantizing_after_attach_rebuilds_the_step() -> None:
    """The step reads the modules' own buffers: once they are replaced, it must not run
    on the old ones, and the next attach reads the new ones."""
    m = make("mixtral")
    ps = prompts(2)
    old = fused_decode.attach(m)
    generate_tokens(m, ps, max_new_tokens=4, temperature=0, batch_size=2, eos=[])
    quantize_model_(m, 8)
    assert not old.weights.fresh()
    assert old(torch.tensor([[1], [2]]), m.new_cache(2, 8)) is None  # stale: modules run
    fused_decode.detach(m)
    ref = generate_tokens(m, ps, max_new_tokens=6, temperature=0, batch_size=2, eos=[])
    fused_decode.attach(m)
    assert m.decode_step is not old
    got = generate_tokens(m, ps, max_new_tokens=6, temperature=0, batch_size=2, eos=[])
    assert got.tokens == ref.tokens


@pytest.mark.parametrize("family, over, reason", [
    ("mixtral", {"first_k_dense_replace": 0, "model_type": "glm4_moe", "n_routed_experts": 4,
                 "moe_intermediate_size": 96, "n_shared_experts": 0}, "sigmoid routing"),
    ("qwen3_moe", {"model_type": "qwen2_moe", "shared_expert_intermediate_size": 32},
     "shared experts"),
])
def test_unsupported_models_keep_the_module_path(family: str, over: dict, reason: str) -> None:
    m = make(family, **over)
    assert fused_decode.attach(m) is None
    assert reason in m.decode_step_reason
    out = generate_tokens(m, prompts(1), max_new_tokens=3, temperature=0, eos=[])
    assert len(out.tokens[0]) == 3


def test_a_training_step_or_grad_mode_keeps_the_module_path() -> None:
    m = make("mixtral")
    fused = fused_decode.attach(m)
    cache = m.new_cache(1, 8)
    ids = torch.tensor([[3]])
    m(torch.tensor([[1, 2]]), cache=cache)  # grad enabled: the prefill and this call
    assert fused(ids, cache) is None
    with torch.no_grad():
        assert fused(ids, cache) is not None
        assert fused(torch.tensor([[3, 4]]), cache) is None  # two tokens: a prefill chunk


def test_the_step_refuses_a_full_cache() -> None:
    m = make("mixtral")
    fused = fused_decode.attach(m)
    cache = m.new_cache(1, 3)
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError, match="holds 3 columns"):
            fused(torch.tensor([[4]]), cache)


def test_env_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEBIT_FUSED_DECODE", "0")
    m = make("mixtral")
    assert fused_decode.attach(m) is None and m.decode_step_reason == "MOEBIT_FUSED_DECODE=0"


def test_packed_decode_rows_match_the_module_path() -> None:
    """The serving engine's packed step of decode rows alone ([1, N] ids over a
    ``RaggedView``, slots out of order, each at its own length) runs natively with the
    logits of the modules."""
    m = make("mixtral", 8, vocab_size=256)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 4, 13)]
    slots = [2, 0, 3]

    def run(fused: bool) -> torch.Tensor:
        cache = SlotKVCache.for_model(m, slots=4, scratch=0)
        outs = []
        with torch.no_grad():
            fused_decode.detach(m)  # prefill on the modules, both times
            for s, seq in zip(slots, seqs, strict=True):
                m(torch.tensor([seq[:-2]]), cache=RaggedView(cache, [(s, len(seq) - 2)]))
            if fused:
                fused_decode.attach(m)
            for step in (-2, -1):
                ids = torch.tensor([[seq[step] for seq in seqs]])
                view = RaggedView(cache, [(s, 1) for s in slots])
                outs.append(m(ids, cache=view, logits_to_keep=torch.tensor([2, 0])).logits)
        assert cache.lengths == [len(seqs[1]), 0, len(seqs[0]), len(seqs[2])]
        return torch.cat(outs)

    ref = run(False)
    got = run(True)
    assert m.decode_step.steps == 2
    torch.testing.assert_close(got, ref, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("bits", [None, 8])
def test_prompt_chunks_run_natively_with_the_module_paths_logits(bits: int | None) -> None:
    """A prompt chunk is rows of one slot at consecutive columns: packed with a decode
    row ([1, N] over a ``RaggedView``) it runs in the native step, and the kept logits
    and the keys and values it wrote equal the module path's."""
    m = make("mixtral", bits, vocab_size=256)
    g = torch.Generator().manual_seed(1)
    seq0, seq1 = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 9))

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cache = SlotKVCache.for_model(m, slots=2, scratch=0)
        with torch.no_grad():
            fused_decode.detach(m)
            m(torch.tensor([seq1[:-1]]), cache=RaggedView(cache, [(1, len(seq1) - 1)]))
            if fused:
                fused_decode.attach(m)
            a = m(torch.tensor([[seq1[-1], *seq0[:12]]]), cache=RaggedView(cache, [(1, 1), (0, 12)]),
                  logits_to_keep=torch.tensor([0, 12])).logits
            b = m(torch.tensor([seq0[12:]]), cache=RaggedView(cache, [(0, 18)]),
                  logits_to_keep=1).logits
        assert cache.lengths == [30, 9]
        return torch.cat([a, b], 1), torch.stack([k[:, :, :30] for k in cache.k])

    ref, ref_k = run(False)
    got, got_k = run(True)
    assert m.decode_step.steps == 2 and got.shape == (1, 3, 256)
    torch.testing.assert_close(got, ref, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(got_k, ref_k, atol=1e-4, rtol=1e-4)


def test_head_columns_follow_logits_to_keep() -> None:
    assert fused_decode.head_columns(5, 0) is None and fused_decode.head_columns(5, 9) is None
    assert fused_decode.head_columns(5, 2).tolist() == [3, 4]
    assert fused_decode.head_columns(5, torch.tensor([0, 4])).tolist() == [0, 4]
    assert fused_decode.head_columns(5, torch.tensor([], dtype=torch.long)).numel() == 0
    with pytest.raises(IndexError, match="outside the step's 5 columns"):
        fused_decode.head_columns(5, torch.tensor([5]))


def test_native_groups_cut_chunks_at_the_call_size() -> None:
    from moebit.serve.ragged import native_groups

    def req(prompt: int, prefilled: int) -> Request:
        r = Request("r", [1] * prompt, SamplingParams(), lambda e: None)
        r.prefilled = prefilled
        return r

    d1, d2, c1, c2 = req(3, 3), req(4, 4), req(10, 0), req(7, 2)
    groups = native_groups([(c1, 10), (d1, 1), (c2, 5), (d2, 1)], 4)
    assert [[(id(r), n) for r, n in g] for g in groups] == [
        [(id(d1), 1), (id(d2), 1), (id(c1), 2)], [(id(c1), 4)], [(id(c1), 4)],
        [(id(c2), 4)], [(id(c2), 1)]]


def engine_texts(m: HFDecoder, prompts: list, max_tokens: list[int], max_batch_tokens: int,
                 engine: str = "ragged") -> list[list[int]]:
    """Greedy texts of ``prompts`` (row i up to ``max_tokens[i]``) through the serving
    engine, all submitted at once into 3 slots (later ones join as others leave)."""
    eng = Engine(m, ByteTokenizer(), max_batch=3, max_queue=8,
                 max_batch_tokens=max_batch_tokens, engine=engine)
    reqs = [Request(str(i), list(p), SamplingParams(max_tokens=n, temperature=0),
                    lambda e: None) for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))]
    for r in reqs:
        eng.submit(r)
    with torch.no_grad():  # as Engine.run steps
        while eng.busy():
            eng.step()
    return [r.out for r in reqs]


@pytest.mark.parametrize("engine", ["ragged", "legacy"])
def test_the_serving_engine_gives_the_module_paths_text(engine: str) -> None:
    """Requests joining and leaving while others decode, in both engines: every text
    equals the one the modules give, and the native step served the decode steps."""
    m = make("mixtral", vocab_size=256)
    m.config.block_size = 64
    prompts = [b"def f(x):\n", b"class A:", b"import os\nimport", b"x = 1"]

    def serve(fused: bool) -> list[list[int]]:
        if fused:
            fused_decode.attach(m)
        else:
            fused_decode.detach(m)
        return engine_texts(m, prompts, [6 + 2 * i for i in range(len(prompts))],
                            max_batch_tokens=8, engine=engine)

    want = serve(False)
    got = serve(True)
    assert got == want and all(want)
    assert m.decode_step.steps > 0


def test_calls_cut_at_max_rows_give_the_same_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """With native calls of at most 5 tokens, prompt chunks are cut across calls (and a
    call of one engine step may hold decode rows and two requests' chunks): the texts
    still equal the modules'."""
    m = make("mixtral", vocab_size=256)
    m.config.block_size = 64
    ps = [b"def f(x):\n  return", b"class A:", b"import os\nimport sys"]

    def serve(fused: bool) -> list[list[int]]:
        (fused_decode.attach if fused else fused_decode.detach)(m)
        return engine_texts(m, ps, [5 + i for i in range(len(ps))], max_batch_tokens=12)

    want = serve(False)
    monkeypatch.setattr(fused_decode, "MAX_ROWS", 5)
    got = serve(True)
    assert got == want and all(want)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (8, 0)])
def test_8bit_activations_give_the_exact_product_of_the_rounded_blocks(
        isa: str, bits: int, group: int) -> None:
    """The int4 / int8 x int8-activation products (integer dot products per block of 32;
    int8 weights with scales per 32 or per channel) equal, to float rounding, the product
    of the dequantized weights and the activations rounded to 8 bits per block (d =
    max|x| / 127, round half to even). The shapes mix every pass: four blocks, two, one."""
    from moebit.inference import qgemv

    lib = fused_decode._fused_c.load(isa)
    torch.manual_seed(0)
    for r, n, k in ((1, 48, 64), (3, 40, 96), (6, 17, 128), (2, 33, 224), (1, 20, 288), (2, 9, 32)):
        qw = qgemv.quantize_weight(torch.randn(n, k), bits, group)
        x = torch.randn(r, k)
        x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
        y = torch.empty(r, n)
        xq, xd, xc = torch.empty(r * k, dtype=torch.int8), torch.empty(r * k // 32), torch.empty(r * k // 32)
        s = qw.s.contiguous()
        if bits == 4:
            lib.fd_q4q8(qw.q.data_ptr(), s.data_ptr(), x.data_ptr(), r, n, k, xq.data_ptr(),
                        xd.data_ptr(), xc.data_ptr(), y.data_ptr())
        else:
            lib.fd_q8q8(qw.q.data_ptr(), s.data_ptr(), int(group == 0), x.data_ptr(), r, n, k,
                        xq.data_ptr(), xd.data_ptr(), xc.data_ptr(), y.data_ptr())
        xb = x.reshape(r, k // 32, 32)
        d = xb.abs().amax(-1, keepdim=True) / 127
        xr = (torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(r, k)
        want = xr.double() @ qgemv.dequantize_weight(qw).double().t()
        torch.testing.assert_close(y.double(), want, atol=5e-5, rtol=1e-5)
        # and the rounding itself: each activation within half its block's step
        assert ((xr - x).abs() <= d.repeat_interleave(32, 1).reshape(r, k) / 2 + 1e-7).all()


# head_dim 64, rows of 2 blocks; and rows of whole quads of blocks written in pieces (four
# heads of 32 share one quad; an expert width of 7 blocks is quantized 2 blocks at a time)
SHAPES = {"pairs": dict(num_attention_heads=1, num_key_value_heads=1),
          "quads": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=224)}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_int8_activations_stay_close_and_are_asked_for(bits: int, shape: str) -> None:
    m = make("mixtral", bits, **SHAPES[shape])
    ps = prompts(3)
    assert fused_decode.attach(m) is not None and not m.decode_step.int8_activations
    ref = two_steps(m, ps)
    assert fused_decode.attach(m, int8_activations=True) is not None, m.decode_step_reason
    got = two_steps(m, ps)
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < 0.03  # rounded activations: close, not equal
    assert fused_decode.attach(m, auto=True).int8_activations  # kept by generate's attach


def test_int8_activations_name_the_weights_they_cannot_meet() -> None:
    from moebit.inference.quantize import quantize_experts_

    f32 = make("mixtral", num_attention_heads=1, num_key_value_heads=1)  # float: no use
    assert fused_decode.attach(f32, int8_activations=True) is None
    assert "no int4 or int8 weight" in f32.decode_step_reason
    g64 = make("mixtral", num_attention_heads=1, num_key_value_heads=1, intermediate_size=128)
    quantize_experts_(g64, bits=8, group=64)
    assert fused_decode.attach(g64, int8_activations=True) is None
    assert "groups of 32 or one scale per output channel" in g64.decode_step_reason
    g32 = make("mixtral", num_attention_heads=1, num_key_value_heads=1)
    quantize_experts_(g32, bits=8, group=32)  # Q8_0's blocks: served
    assert fused_decode.attach(g32, int8_activations=True) is not None, g32.decode_step_reason


def test_generate_cli_takes_int8_activations_and_names_what_they_need(tmp_path) -> None:
    """``moebit generate FOLDER --quantize int4|int8 --activations int8`` decodes a real
    transformers-written folder on the native step; without quantized weights the flag
    is a one-line error before anything loads."""
    import json
    import os
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=1, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def gen(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "moebit.cli", "generate", str(tmp_path / "m"),
                               "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "4",
                               "--threads", "1", *flags], env=env, text=True,
                              capture_output=True, timeout=300, check=False)

    r = gen("--quantize", "int4", "--activations", "int8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("def ")
    assert json.loads(r.stderr.strip().splitlines()[-1])["activations"] == "int8"
    r = gen("--quantize", "int8", "--activations", "int8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("def ")
    r = gen("--activations", "int8")
    assert r.returncode != 0
    assert "--activations int8 rounds the activations quantized weights meet" in r.stderr


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_scaled_rope_matches_the_module_path(rope: dict) -> None:
    """Linear scaling reads a position table; dynamic NTK rescales with the longest
    position, so the step computes cos / sin each call as the modules do. Dynamic rope
    keeps state between calls: each path gets a fresh model of the same weights."""
    ps = prompts(3)  # rows of 5, 8 and 11 tokens: past max_position_embeddings
    ref_model = make("mixtral", None, rope_scaling=rope, max_position_embeddings=8)
    fused_decode.detach(ref_model)
    ref = two_steps(ref_model, ps)
    m = make("mixtral", None, rope_scaling=rope, max_position_embeddings=8)
    fused = fused_decode.attach(m)
    assert fused.tabled == (rope["rope_type"] == "linear")
    torch.testing.assert_close(two_steps(m, ps), ref, atol=1e-5, rtol=1e-5)
    assert fused.steps == 2
