"""``moebit bench inference``: generation latency and throughput, our MoE path against the baseline.

    moebit bench inference --run runs/issue7-moe64 --dense runs/issue7-dense --json inf.json
    moebit bench inference --synthetic --experts 64 --d-model 512 --json inf-syn.json

Every variant decodes with the same KV-cache loop (``moebit.inference.generate``) and the same
weights; only the MoE layers' execution differs:

- ``moebit``: sort-based dispatch (index gathers, one block per expert, only the chosen
  experts run), experts in float32, ``bf16`` (experts cast to bfloat16) or ``int8``
  (``moebit.inference.quantize``, weight-only, per-output-channel scales).
- ``onehot_baseline``: THE BASELINE, not our code path: the GShard / DeepSpeed (<= 2025)
  one-hot dispatch, [S, E, C] dispatch and combine tensors and two einsums, every expert
  running its C slots. C is the smallest capacity that drops nothing in that call (the
  largest expert load), so the baseline computes the same outputs as ours and is never
  padded more than it must be (DeepSpeed's eval capacity would be at least 4).
- ``dense``: a dense model (``--dense RUN``), float32, for quality-equivalent comparisons.

Measures: per-token latency at batch 1 (median decode step, ms), tokens/s at batch 32
(new tokens over prefill + decode time), validation loss (dropless, float32 activations)
of each expert format, expert weight bytes; and ``--ranks 2``: the same with the experts
split over 2 gloo ranks (1 thread each, against 1 rank with 2 threads). Variants are timed
interleaved, rep by rep, so foreign load on a shared machine hits all alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebit.inference.generate import dropless, generate_tokens
from moebit.inference.loading import load_model
from moebit.inference.quantize import Int8Experts, quantize_experts_
from moebit.models.gpt import GPT, GPTConfig
from moebit.models.registry import new_model
from moebit.moe import MoE, ResidualMoE
from moebit.moe.experts import Experts
from moebit.testing import run_on_ranks
from moebit.training.config import build
from moebit.training.data import load_corpus, val_batches

# ----------------------------------------------------------------------------- baseline


@dataclass
class _BaselineOutput:
    hidden: torch.Tensor
    aux_loss: torch.Tensor


class OneHotMoE(nn.Module):
    """BASELINE: an MoE layer's forward through GShard one-hot [S, E, C] einsums (same weights)."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        if moe.ep_groups is not None:
            raise ValueError("the one-hot baseline runs on one rank only")
        self.moe = moe

    def forward(self, x: torch.Tensor) -> _BaselineOutput:
        moe = self.moe
        x_SD = x.reshape(-1, moe.d_model)
        s, e_num, k = x_SD.shape[0], moe.config.num_experts, moe.config.k
        zero = x.new_zeros((), dtype=torch.float32)
        if s == 0:
            return _BaselineOutput(x.clone(), zero)
        _, _, expert_SK, weight_SK = moe.gate.choose(x_SD)  # the same router as our path
        ex = moe.experts
        dt = ex.w1.dtype
        cap = max(1, int(torch.bincount(expert_SK.reshape(-1), minlength=e_num).max()))
        # slot of each (token, choice) in its expert's buffer, first choices first
        mask_PE = F.one_hot(expert_SK.t().reshape(-1), e_num)
        slot_P = ((mask_PE.cumsum(0) - 1) * mask_PE).sum(1)
        disp_PEC = mask_PE.to(dt).unsqueeze(2) * F.one_hot(slot_P, cap).to(dt).unsqueeze(1)
        disp_SEC = disp_PEC.view(k, s, e_num, cap).sum(0)
        comb_SEC = (disp_PEC * weight_SK.t().reshape(-1, 1, 1).to(dt)).view(k, s, e_num, cap).sum(0)
        x_ECD = torch.einsum("sec,sd->ecd", disp_SEC, x_SD.to(dt))
        h_ECF = F.gelu(torch.baddbmm(ex.b1.unsqueeze(1), x_ECD, ex.w1))
        y_ECD = torch.baddbmm(ex.b2.unsqueeze(1), h_ECF, ex.w2)
        out_SD = torch.einsum("sec,ecd->sd", comb_SEC, y_ECD).to(x.dtype)
        return _BaselineOutput(out_SD.view(x.shape), zero)


class _OneHotResidual(nn.Module):
    """BASELINE for Residual MoE: the same mix of MLP and (one-hot) MoE."""

    def __init__(self, res: nn.Module) -> None:
        super().__init__()
        self.res, self.onehot = res, OneHotMoE(res.moe)

    def forward(self, x: torch.Tensor) -> _BaselineOutput:
        m = self.onehot(x)
        c = torch.softmax(self.res.coef(x), dim=-1)
        return _BaselineOutput(m.hidden * c[..., 0:1] + self.res.mlp(x) * c[..., 1:2], m.aux_loss)


@contextmanager
def onehot_dispatch(model: GPT) -> Iterator[None]:
    """Run the model's MoE blocks through the one-hot baseline inside; restored after."""

    saved = []
    for block in model.blocks:
        f = block.ffn
        if isinstance(f, (MoE, ResidualMoE)):
            saved.append((block, f))
            block.ffn = OneHotMoE(f) if isinstance(f, MoE) else _OneHotResidual(f)
    try:
        yield
    finally:
        for block, f in saved:
            block.ffn = f


# ----------------------------------------------------------------------------- models


def expert_bytes(model: nn.Module) -> int:

    total = 0
    for m in model.modules():
        if isinstance(m, Experts):
            total += sum(p.numel() * p.element_size() for p in m.parameters())
        elif isinstance(m, Int8Experts):
            total += m.weight_bytes()
    return total


def variants(base: GPT, formats: list[str]) -> dict[str, GPT]:
    """One model per expert format; "bf16" casts the experts only, "int8" quantizes them."""

    out = {}
    for fmt in formats:
        if fmt == "fp32":
            out[fmt] = base
        elif fmt == "bf16":
            m = copy.deepcopy(base)
            for mod in m.modules():
                if isinstance(mod, Experts):
                    mod.to(torch.bfloat16)
            out[fmt] = m
        elif fmt == "int8":
            m = copy.deepcopy(base)
            quantize_experts_(m)
            out[fmt] = m
        else:
            raise ValueError(f"unknown expert format {fmt!r}: fp32, bf16 or int8")
    return out


def synthetic_config(a: argparse.Namespace, ep_size: int = 1) -> GPTConfig:
    return GPTConfig(n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, block_size=a.block_size,
                     num_experts=a.experts, moe_every=2,
                     moe={"num_experts_per_tok": a.k, "ep_size": ep_size})


def build_model(a: argparse.Namespace, ep_size: int = 1, rank: int = 0) -> GPT:
    if a.synthetic:
        torch.manual_seed(0)  # experts are drawn in global order: any ep_size gets the same
        return new_model(synthetic_config(a, ep_size)).eval()
    return load_model(a.run, ep_size=ep_size, rank=rank)


# ----------------------------------------------------------------------------- timing


def _prompts(n: int, length: int) -> list[list[int]]:
    text = b"def main(argv):\n    import os, sys\n    for name in sorted(os.listdir('.')):\n"
    return [list((text * 4)[i % 7: i % 7 + length]) for i in range(n)]


def time_generation(model: GPT, batch: int, new_tokens: int, prompt_len: int) -> dict[str, float]:
    res = generate_tokens(model, _prompts(batch, prompt_len), max_new_tokens=new_tokens,
                          temperature=0, batch_size=batch)
    n_new = sum(len(t) for t in res.tokens)
    if not res.per_step_s:  # an expert-parallel rank with no prompt of its own
        return {"ms_per_step": float("nan"), "tokens_per_s": float("nan")}
    return {"ms_per_step": 1e3 * statistics.median(res.per_step_s),
            "tokens_per_s": n_new / (res.prefill_s + res.decode_s)}


def baseline_agrees(model: GPT, a: argparse.Namespace) -> bool:
    """Whether the baseline and our path generate the same greedy tokens (same weights)."""
    prompts = _prompts(4, a.prompt_len)
    ours = generate_tokens(model, prompts, max_new_tokens=16, temperature=0).tokens
    with onehot_dispatch(model):
        theirs = generate_tokens(model, prompts, max_new_tokens=16, temperature=0).tokens
    return ours == theirs


def _run_variant(name: str, model: GPT, batch: int, a: argparse.Namespace) -> dict[str, float]:
    if name.startswith("onehot"):
        with onehot_dispatch(model):
            return time_generation(model, batch, a.new_tokens, a.prompt_len)
    return time_generation(model, batch, a.new_tokens, a.prompt_len)


def timing_table(models: dict[str, GPT], a: argparse.Namespace) -> list[dict[str, Any]]:
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    for batch in (1, 32):
        for name, m in models.items():  # warm-up
            _run_variant(name, m, batch, argparse.Namespace(**{**vars(a), "new_tokens": 4}))
        for _ in range(a.reps):
            for name, m in models.items():
                rows.setdefault((name, batch), []).append(_run_variant(name, m, batch, a))
    out = []
    for (name, batch), reps in rows.items():
        out.append({"variant": name, "batch": batch,
                    "ms_per_step": statistics.median(r["ms_per_step"] for r in reps),
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps)})
    return out


def _ranks_body(rank: int, world: int, a_dict: dict[str, Any]) -> list[dict[str, Any]]:
    a = argparse.Namespace(**a_dict)
    torch.set_num_threads(1)

    int8 = build_model(a, ep_size=world, rank=rank)  # process groups cannot be deep-copied
    quantize_experts_(int8)
    models = {"moebit-fp32": build_model(a, ep_size=world, rank=rank), "moebit-int8": int8}
    # rank 0 holds the batch-1 prompt (and half of the batch-32 prompts): its times count
    rows = []
    for batch in (1, 32):
        for name, m in models.items():
            time_generation(m, batch, 4, a.prompt_len)  # warm-up
            reps = [time_generation(m, batch, a.new_tokens, a.prompt_len) for _ in range(a.reps)]
            rows.append({"variant": name, "batch": batch, "ranks": world,
                         "ms_per_step": statistics.median(r["ms_per_step"] for r in reps),
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps)})
    return rows


def ranks_table(a: argparse.Namespace, rounds: int = 2) -> list[dict[str, Any]]:
    """1 rank against ``a.ranks`` expert-parallel ranks, all in fresh processes of 1 thread,
    alternated round by round (1, N, 1, N) so that both meet the same machine load."""

    got: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for world in (1, a.ranks):
            for r in run_on_ranks(_ranks_body, world=world, args=(vars(a),), timeout=1800)[0]:
                got.setdefault((r["variant"], r["batch"], world), []).append(r)
    return [{"variant": f"{v} (spawned)", "batch": b, "ranks": w,
             "ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
             "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs)}
            for (v, b, w), rs in got.items()]


# ----------------------------------------------------------------------------- quality


@torch.no_grad()
def val_loss(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss (nats/byte), dropless routing, eval mode."""
    model.eval()
    with dropless(model):
        return sum(float(model(x, y).loss) for x, y in batches) / len(batches)


def quality(a: argparse.Namespace, models: dict[str, GPT]) -> dict[str, Any]:

    cfg = build(json.loads((Path(a.run) / "config.json").read_text()))
    corpus = load_corpus(cfg.data, cfg.encoding, cfg.encoding_errors)
    vb = val_batches(corpus.val, cfg.model.block_size, cfg.batch_size, a.eval_batches, cfg.seed)
    out: dict[str, Any] = {}
    for fmt, m in models.items():
        out[fmt] = {"val_loss": val_loss(m, vb), "expert_bytes": expert_bytes(m)}
    if "int8" in models:  # the int8 kernel on every block (bf16 activations), as in decoding
        m = copy.deepcopy(models["fp32"])
        quantize_experts_(m, kernel="int8")
        out["int8-kernel-only"] = {"val_loss": val_loss(m, vb), "expert_bytes": expert_bytes(m)}
    for path in a.dense:
        dense = load_model(path)
        out[f"dense ({Path(path).name})"] = {"val_loss": val_loss(dense, vb), "expert_bytes": 0,
                                             "params": dense.num_params()}
    return out


# ----------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit bench inference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a trained MoE run (or checkpoint) folder")
    src.add_argument("--synthetic", action="store_true", help="random weights, shape from the flags")
    ap.add_argument("--dense", action="append", default=[],
                    help="a trained dense run to compare with, timing and val loss (repeatable)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--formats", default="fp32,bf16,int8", help="expert formats of our path")
    ap.add_argument("--new-tokens", type=int, default=32, help="generated per prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the 1-rank runs (ranks of --ranks use 1 each)")
    ap.add_argument("--ranks", type=int, default=2,
                    help="also time expert parallel on this many ranks (1: skip)")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--no-quality", action="store_true", help="skip the validation losses (--run)")
    ap.add_argument("--no-single", action="store_true",
                    help="skip the 1-process variant comparison (only --ranks and quality)")
    ap.add_argument("--json", help="write the results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    base = build_model(a)
    formats = [f for f in a.formats.split(",") if f]
    models = variants(base, formats)
    timed: dict[str, GPT] = {f"moebit-{k}": m for k, m in models.items()}
    timed["onehot_baseline-fp32"] = models.get("fp32", base)
    if "bf16" in models:
        timed["onehot_baseline-bf16"] = models["bf16"]
    for path in a.dense:
        timed[f"dense-fp32 ({Path(path).name})"] = load_model(path)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = [] if a.no_single else timing_table(timed, a)
    for r in rows:
        r["ranks"] = 1
    if a.ranks > 1:
        rows += ranks_table(a)
    result: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
                   f"torch {torch.__version__}, threads {a.threads}",
        "load_avg_start": load, "load_avg_end": os.getloadavg()[0],
        "model": base.config.to_dict(), "source": a.run or "synthetic",
        "expert_bytes": {k: expert_bytes(m) for k, m in models.items()},
        "timing": rows, "seconds": time.perf_counter() - t0,
        "baseline_tokens_equal_ours": None if a.no_single else baseline_agrees(models.get("fp32", base), a),
    }
    if a.run and not a.no_quality:
        result["quality"] = quality(a, models)
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def format_table(res: dict[str, Any]) -> str:
    rows = res["timing"]
    base = {r["batch"]: r for r in rows if r["variant"] == "onehot_baseline-fp32" and r["ranks"] == 1}
    lines = ["| variant | ranks | batch | ms / decode step | tokens/s | baseline ms / ours ms |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["ranks"], r["variant"])):
        b = base.get(r["batch"])
        ratio = f"{b['ms_per_step'] / r['ms_per_step']:.2f}" if b and "spawned" not in r["variant"] else "-"
        lines.append(f"| {r['variant']} | {r['ranks']} | {r['batch']} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {ratio} |")
    if "quality" in res:
        q = res["quality"]
        ref = q.get("fp32", {}).get("val_loss")
        lines += ["", "| experts | val loss | vs fp32 | expert MB |", "|---|---|---|---|"]
        for k, v in q.items():
            rel = f"{100 * (v['val_loss'] / ref - 1):+.2f}%" if ref else "-"
            lines.append(f"| {k} | {v['val_loss']:.4f} | {rel} | {v['expert_bytes'] / 1e6:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
