"""A rank with no rows: it sends nothing, receives nothing, or both, in every wire format.

Expert parallelism meets empty shards all the time: a rank whose experts no token chose
(a young router often sends everything to a few experts), a rank with no prompt of its own
that only serves its experts while the others decode, a chunk of the overlapped exchange
that holds no row. Each used to crash on a reshape that had to infer a dimension from zero
elements ("cannot reshape tensor of 0 elements into shape [0, -1]"). Here every path runs
with such a rank on 2 real gloo ranks: the all-to-all in each format, forward and backward;
an MoE layer's training forward and backward and its ``infer``; a GPT's training step and
its evaluation; KV-cache generation of a single prompt by moebit's GPT and by a Hugging
Face decoder, the model-level path of ``moebit generate --nproc 2 --ep-size 2`` and of
``moebit serve --nproc 2 --ep-size 2``.
"""

from __future__ import annotations

import pytest
import torch

from moebit.comm.all_to_all import _fp8_unsupported, decode, encode
from moebit.testing import run_on_ranks

FORMATS = ["auto", "fp32", "bf16", "fp16", "int8", "fp8_e4m3"]
TOL = {"auto": 0.0, "fp32": 0.0, "bf16": 2.0**-7, "fp16": 2.0**-10, "int8": 1 / 127,
       "fp8_e4m3": 2.0**-3}


def formats() -> list[str]:
    return [f for f in FORMATS if not (f == "fp8_e4m3" and _fp8_unsupported("cpu"))]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(0, 16), (0, 2, 8)])
def test_zero_rows_encode_and_decode(fmt: str, shape: tuple[int, ...]):
    if fmt == "fp8_e4m3" and _fp8_unsupported("cpu"):
        pytest.skip(f"fp8: {_fp8_unsupported('cpu')}")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(shape, dtype=dtype)
        wire = encode(x, fmt)
        assert wire.shape[0] == 0
        back = decode(wire, fmt, dtype, 16)
        assert back.shape[0] == 0 and back.numel() == 0 and back.dtype == dtype


@pytest.mark.parametrize("kernel", ["loop", "padded", "grouped", "threaded"])
@pytest.mark.parametrize("expert_type", ["gelu_mlp", "swiglu"])
def test_experts_run_no_rows_forward_and_backward(kernel: str, expert_type: str):
    """What a rank whose experts no token chose runs: every kernel on [0, d] rows."""
    from moebit.moe.experts import Experts

    experts = Experts(4, 16, 24, first_expert=2, num_local=2, expert_type=expert_type,
                      kernel=kernel)
    for bf16 in (False, True):
        x = torch.zeros(0, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = experts(x, [0, 0])
        assert y.shape == (0, 16)
        y.float().sum().backward()
        assert x.grad is not None and x.grad.shape == (0, 16)
        for p in experts.parameters():
            assert p.grad is None or p.grad.abs().sum() == 0


# ------------------------------------------------------------------ the all-to-all itself

# (rows rank 0 sends to rank 0 and 1, rows rank 1 sends to rank 0 and 1)
CASES = {"isolated": ([5, 0], [0, 0]),     # rank 1 sends and receives nothing
         "receive_only": ([2, 3], [0, 0]),  # rank 1 has no rows but gets some
         "send_only": ([0, 0], [4, 0]),     # rank 1's rows all leave; nothing comes back
         "nobody": ([0, 0], [0, 0])}        # an exchange of nothing at all


def _a2a_body(rank: int, world: int, fmts: list[str]) -> dict:
    from moebit.comm.all_to_all import all_to_all_rows, make_route

    out = {}
    for name, splits in CASES.items():
        send = list(splits[rank])
        recv = [splits[0][rank], splits[1][rank]]
        for fmt in fmts:
            for grad_fmt in ("auto", fmt):
                gen = torch.Generator().manual_seed(100 * rank + 7)
                x = torch.randn(sum(send), 16, generator=gen, requires_grad=True)
                y = all_to_all_rows(x, make_route(send, recv, None), fmt, grad_fmt)
                (y * torch.arange(1.0, 17.0)).sum().backward()
                out[name, fmt, grad_fmt] = (x.detach(), y.detach(), x.grad)
    return out


def test_all_to_all_with_an_empty_rank_in_every_format():
    fmts = formats()
    r0, r1 = run_on_ranks(_a2a_body, 2, args=(fmts,), timeout=240)
    for (name, fmt, grad_fmt), (x0, y0, g0) in r0.items():
        x1, y1, g1 = r1[name, fmt, grad_fmt]
        (s00, s01), (s10, s11) = CASES[name]
        # what each rank receives: rank 0's rows for it, then rank 1's rows for it
        want0 = torch.cat([x0[:s00], x1[:s10]])
        want1 = torch.cat([x0[s00:s00 + s01], x1[s10:s10 + s11]])
        for got, want in ((y0, want0), (y1, want1)):
            assert got.shape == want.shape, (name, fmt)
            tol = TOL[fmt] * want.abs().amax().item() if want.numel() else 0.0
            assert (got - want).abs().max().item() <= tol if want.numel() else True, (name, fmt)
        # gradients: d(sum(y * w))/dx = w for every row, back in the sender's order
        w = torch.arange(1.0, 17.0)
        for x, g in ((x0, g0), (x1, g1)):
            assert g.shape == x.shape, (name, fmt, grad_fmt)
            if g.numel():
                gtol = TOL[grad_fmt] * 16
                assert (g - w).abs().max().item() <= gtol, (name, fmt, grad_fmt)


# ------------------------------------------------------------------ an MoE layer

def _moe_layer_body(rank: int, world: int, fmts: list[str]) -> dict:
    from moebit.comm.collectives import broadcast_params_
    from moebit.moe import MoE, MoEConfig, expert_parallel_groups

    groups = expert_parallel_groups(2)
    out = {}
    for fmt in fmts:
        for chunks in (1, 2):
            torch.manual_seed(0)
            cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, ep_size=2, a2a_dtype=fmt,
                            a2a_grad_dtype=fmt, a2a_chunks=chunks, drop_tokens=False)
            layer = MoE(16, cfg, groups)
            broadcast_params_(layer)  # the gate everywhere alike (experts stay per rank)
            with torch.no_grad():  # every token to experts 0 and 1, both on rank 0
                layer.gate.router.weight.zero_()
                layer.gate.router.weight[:2] = 1.0
            # rank 0: positive tokens, routed to its own experts; rank 1: no tokens at all
            x = (torch.rand(3, 4, 16) + 0.1) if rank == 0 else torch.zeros(0, 4, 16)
            x.requires_grad_(True)
            res = layer(x)
            (res.hidden.float().square().sum() + res.aux_loss).backward()
            grads = [p.grad for p in layer.experts.parameters()]
            with torch.no_grad():
                inferred = layer.eval().infer(x.detach().reshape(-1, 16))
            layer.train()
            out[fmt, chunks] = {"hidden": res.hidden.detach(), "aux": float(res.aux_loss),
                                "x_grad": x.grad, "expert_grads": grads, "infer": inferred}
    return out


def test_moe_layer_with_a_rank_that_has_no_tokens():
    r0, r1 = run_on_ranks(_moe_layer_body, 2, args=(formats(),), timeout=240)
    for key, a in r0.items():
        b = r1[key]
        assert a["hidden"].shape == (3, 4, 16) and b["hidden"].shape == (0, 4, 16), key
        assert torch.isfinite(a["hidden"]).all() and a["hidden"].abs().sum() > 0, key
        assert b["x_grad"].shape == (0, 4, 16) and torch.isfinite(a["x_grad"]).all(), key
        assert a["aux"] == a["aux"] and b["aux"] == b["aux"], key  # finite, no 0/0
        # rank 0's experts did the work; rank 1's got no token and no gradient
        assert all(g is not None and g.abs().sum() > 0 for g in a["expert_grads"]), key
        assert all(g is None or g.abs().sum() == 0 for g in b["expert_grads"]), key
        assert b["infer"].shape == (0, 16), key
        fmt = key[0]
        tol = max(TOL[fmt], 1e-6) * 4 * a["infer"].abs().amax().item()
        assert (a["infer"].view(3, 4, 16) - a["hidden"]).abs().max().item() <= tol, key


# ------------------------------------------------------------------ a GPT: train step, eval

def _gpt_body(rank: int, world: int, fmts: list[str]) -> dict:
    from moebit.comm.collectives import init_from_env
    from moebit.models.registry import build_model
    from moebit.moe import TopKGate
    from moebit.training.config import build
    from moebit.training.evaluation import evaluate
    from moebit.training.setup import broadcast_model

    info = init_from_env("cpu")
    out = {}
    for fmt in fmts:
        cfg = build({"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 16,
                     "num_experts": 4, "ep_size": 2, "num_experts_per_tok": 1, "a2a_dtype": fmt,
                     "a2a_grad_dtype": fmt, "dtype": "fp32", "bias_update_speed": 0.001})
        torch.manual_seed(0)
        model = build_model(cfg)
        broadcast_model(model)
        for g in model.modules():  # the selection bias sends every token to expert 0 (rank 0)
            if isinstance(g, TopKGate):
                g.e_score_correction_bias.copy_(torch.tensor([100.0, -100.0, -100.0, -100.0]))
        gen = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 256, (2, 16), generator=gen)
        model.train()
        o = model(x, x)
        (o.loss + o.aux_loss).backward()
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        same = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))
        val = evaluate(model, [(same, same)], "fp32", info.device)  # every rank: the same windows
        out[fmt] = {"loss": float(o.loss), "val": val,
                    "expert_grad": sum(float(p.grad.abs().sum()) for p in experts if p.grad is not None)}
    return out


def test_gpt_train_step_and_evaluation_with_a_rank_whose_experts_get_nothing():
    r0, r1 = run_on_ranks(_gpt_body, 2, args=(formats(),), timeout=300)
    for fmt in formats():
        for r in (r0, r1):
            assert torch.isfinite(torch.tensor([r[fmt]["loss"], r[fmt]["val"]])).all(), fmt
        assert r0[fmt]["val"] == r1[fmt]["val"], fmt  # the same windows, the same model
        assert r0[fmt]["expert_grad"] > 0 and r1[fmt]["expert_grad"] == 0, fmt


# ------------------------------------------------------------------ generation of one prompt

def _gpt_generate_body(rank: int, world: int) -> list[list[int]]:
    from moebit.inference.generate import generate_tokens
    from moebit.models.registry import build_model
    from moebit.training.config import build
    from moebit.training.setup import broadcast_model

    out = []
    for fmt in formats():
        cfg = build({"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32,
                     "num_experts": 4, "ep_size": 2, "a2a_dtype": fmt, "dtype": "fp32"})
        torch.manual_seed(0)
        model = build_model(cfg)
        broadcast_model(model)
        out.append(generate_tokens(model, [list(b"def f")], max_new_tokens=6, temperature=0).tokens[0])
    return out


def test_gpt_generates_one_prompt_on_two_expert_parallel_ranks():
    r0, r1 = run_on_ranks(_gpt_generate_body, 2, timeout=240)
    assert r0 == r1 and all(len(t) == 6 for t in r0)


def _hf_generate_body(rank: int, world: int, folder: str) -> dict:
    from moebit.hf import from_pretrained
    from moebit.inference.generate import generate_tokens

    model = from_pretrained(folder, ep_size=world, rank=rank).eval()
    one = generate_tokens(model, [[5, 9, 17]], max_new_tokens=5, temperature=0).tokens
    # serve's decode path: the model's forward on a zero-row batch of a KV cache
    with torch.no_grad():
        empty = model(torch.zeros(0, 1, dtype=torch.long), cache=model.new_cache(0, 1),
                      logits_to_keep=1).logits
    return {"one": one, "empty": tuple(empty.shape)}


def test_hf_decoder_generates_one_prompt_on_two_expert_parallel_ranks(tmp_path):
    transformers = pytest.importorskip("transformers")
    from moebit.hf import from_pretrained
    from moebit.inference.generate import generate_tokens

    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    r0, r1 = run_on_ranks(_hf_generate_body, 2, args=(str(tmp_path / "hf"),), timeout=240)
    want = generate_tokens(from_pretrained(tmp_path / "hf").eval(), [[5, 9, 17]],
                           max_new_tokens=5, temperature=0).tokens
    assert r0["one"] == r1["one"] == want
    assert r0["empty"][0] == 0 and r1["empty"][0] == 0
