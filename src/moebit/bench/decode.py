"""``moebit bench decode``: decode ms/token against the memory-bandwidth floor, and the peers.

    moebit bench decode --configs e8 e64 --batch 1 16 --json decode.json
    moebit bench decode --configs e64 --peer llamacpp --batch 1

For each configuration this builds a random Mixtral-style Hugging Face folder with
transformers (byte vocabulary, routers given a realistic spread), loads the very same
weights into moebit in float32, int8 experts and int4 experts (``--quantize``'s formats)
and ``int8_all`` / ``int4_all``: the dense projections (attention, head) quantized too
(``moebit.inference.quantize_dense``), ``int8_all_a8`` / ``int4_all_a8``: the same int8
/ int4 weights multiplied by activations rounded to 8 bits per 32 (``--activations int8``),
and decodes greedily from a ``--prompt``-token prompt for ``--new-tokens`` tokens at each
``--batch``, all on ``--threads`` threads. It measures the machine's streaming read rate
with those threads (``decode_floor.read_bandwidth``) before the run and after each
configuration, and prints every variant's ms per decode step against its floor: the bytes
of weights one token reads in that variant's formats (``decode_floor.weight_bytes``) over
the fastest rate of the run: those probes', or a row's own (its weight bytes over its
time), where a row read faster than the probes did.

Peers, on the same weights, timed interleaved with moebit rep by rep (a busy host slows
all alike):

- transformers ``generate`` (static cache, greedy): per-step ms as (time of n + 1 new
  tokens - time of 1) / n, so its prefill is not counted; ``--no-transformers`` skips it.
- ``--peer llamacpp``: llama.cpp through llama-cpp-python on GGUF F32, Q8_0 and Q4_0
  files written from the same model (``gguf_convert``), same threads, prompt and greedy
  argmax, batch 1 (``decode_llamacpp``); with first-token and full greedy agreement on
  F32 and tokens/s ratios moebit fp32 / F32, int8 / Q8_0, int4 / Q4_0.

Configurations (``--configs``): ``e8`` hidden 1024, 8 layers, 8 experts of width 2048,
top-2, 16 heads (8 KV heads); ``e64`` hidden 512, 4 layers, 64 experts of width 1344
(42 x 32: GGML blocks need rows of whole 32s),
top-2, 8 heads; ``tiny`` (tests) hidden 64, 2 layers, 4 experts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moebit.bench import decode_floor as fl
from moebit.comm._native import cpu_model, select_isa
from moebit.inference import fused_decode
from moebit.inference.generate import generate_tokens
from moebit.inference.quantize import quantize_experts_
from moebit.inference.quantize_dense import quantize_dense_
from moebit.models.hf import from_pretrained
from moebit.models.kv_cache import KV_CACHE_DTYPES, set_kv_dtype

CONFIGS: dict[str, dict[str, int]] = {
    "e8": dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
               num_attention_heads=16, num_key_value_heads=8, num_local_experts=8),
    "e64": dict(hidden_size=512, intermediate_size=1344, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=8, num_local_experts=64),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4),
}
# variant -> (expert bits, dense projections quantized too, 8-bit activations for the int4
# products); "_all": attention and head too; "_a8": llama.cpp's Q8_0 / Q4_0 x Q8_0 arithmetic
MOEBIT_VARIANTS = {"fp32": (None, False, False), "int8": (8, False, False),
                   "int4": (4, False, False), "int8_all": (8, True, False),
                   "int4_all": (4, True, False), "int8_all_a8": (8, True, True),
                   "int4_all_a8": (4, True, True)}
A8 = "_a8"


def build_folder(name: str, folder: Path, seed: int = 0) -> Any:
    """A random transformers Mixtral of configuration ``name`` saved in ``folder``; returns
    it (eval). No BOS/EOS id: greedy runs never stop early and no peer masks a token."""
    import transformers  # the benchmark's peer; build-time only

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=256, num_experts_per_tok=2, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, **CONFIGS[name])
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0, 0.02)  # routers start at zero: give them a realistic spread
    model.save_pretrained(folder, max_shard_size="200MB")
    return model.eval()


def prompts_of(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g).tolist()


def moebit_models(folder: Path, variants: list[str]) -> dict[str, Any]:
    """moebit's models of the folder: float32 and the quantized formats asked for."""
    out = {}
    for v in variants:
        m = from_pretrained(str(folder)).eval()
        bits, dense, _ = MOEBIT_VARIANTS[v]
        if bits is not None:
            quantize_experts_(m, bits=bits)
        if dense:
            quantize_dense_(m, bits=bits)
        out[f"moebit_{v}"] = m
    return out


MODULES = "_modules"  # the suffix of a row decoded through the torch modules, step by step


def _moebit_run(m: Any, prompts: list[list[int]], new: int, fused: bool = True,
                a8: bool = False) -> tuple[float, list[int]]:
    """(median decode step s, the first prompt's greedy tokens); ``fused``: each step in
    one native call (``fused_decode``; ``a8``: its int4 products on 8-bit activations),
    else through the model's modules."""
    if fused:
        fused_decode.attach(m, int8_activations=a8)
    else:
        fused_decode.detach(m)
    r = generate_tokens(m, prompts, max_new_tokens=new, temperature=0,
                        batch_size=len(prompts), eos=[])
    return statistics.median(r.per_step_s), r.tokens[0]


def _hf_runner(hf: Any, prompts: list[list[int]]) -> Any:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def gen(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, cache_implementation="static", pad_token_id=0)
        return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()

    def run(new: int) -> tuple[float, list[int]]:
        t_all, toks = gen(new)
        t_one, _ = gen(1)
        return (t_all - t_one) / max(1, new - 1), toks

    return run


def time_batch(runners: dict[str, Any], new: int, reps: int) -> dict[str, Any]:
    """Each runner (new -> (step s, greedy tokens)) once per rep, interleaved; a warm-up
    run of 2 tokens first (builds, autotunes, allocates). Median ms/step and tokens."""
    for run in runners.values():
        run(2)
    steps: dict[str, list[float]] = {k: [] for k in runners}
    tokens: dict[str, list[int]] = {}
    for _ in range(reps):
        for k, run in runners.items():
            s, toks = run(new)
            steps[k].append(s)
            tokens[k] = toks
    return {"ms": {k: round(1e3 * statistics.median(v), 3) for k, v in steps.items()},
            "tokens": tokens}


def agreement(a: list[int], b: list[int]) -> dict[str, Any]:
    """First-token agreement and the greedy prefix two tools share (of len(a))."""
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return {"first_token": bool(a and b and a[0] == b[0]), "prefix": same, "of": len(a)}


def floors(dims: fl.Dims, gb_s: float) -> dict[str, dict[str, float]]:
    """Every scheme's weight bytes per token and its floor in ms at ``gb_s``."""
    out = {}
    for name, s in fl.SCHEMES.items():
        nbytes = fl.weight_bytes(dims, s)["total"]
        out[name] = {"weight_bytes": nbytes, "weight_mb": round(nbytes / 1e6, 2),
                     "floor_ms": round(fl.floor_ms(nbytes, gb_s), 3)}
    return out


def _scheme_of(variant: str) -> str:
    """A row's weight formats: ``moebit_int8`` its own, ``llamacpp_Q8_0`` ``llamacpp_q8_0``,
    transformers float32 (the same bytes as moebit's)."""
    if variant == "transformers":
        return "moebit_fp32"
    return variant.lower().removesuffix(MODULES).removesuffix(A8)


def run_config(name: str, args: argparse.Namespace, gb_s: float, tmp: Path) -> dict[str, Any]:
    """Every measurement of one configuration (module docstring)."""
    folder = tmp / name
    hf = build_folder(name, folder)
    cfg = json.loads((folder / "config.json").read_text())
    dims = fl.Dims.of_config(cfg)
    res: dict[str, Any] = {"config": {k: cfg[k] for k in CONFIGS[name]},
                           "floors": floors(dims, gb_s),
                           "kv_mb_at_end": round(fl.kv_bytes(dims, args.prompt + args.new_tokens,
                                                             2 if args.kv_cache == "float16" else 4)
                                                 / 1e6, 2)}
    models = moebit_models(folder, args.variants)
    for m in models.values():
        set_kv_dtype(m, args.kv_cache)
    for k in [k for k in models if k.endswith(A8)]:  # a shape the 8-bit blocks do not fit
        if fused_decode.attach(models[k], int8_activations=True) is None:
            res.setdefault("skipped", {})[k] = models[k].decode_step_reason
            print(f"{name}: {k} skipped: {models[k].decode_step_reason}", file=sys.stderr)
            del models[k]
    peer = None
    if args.peer == "llamacpp":
        from moebit.bench.decode_llamacpp import LlamaCppPeer

        peer = LlamaCppPeer(models.get("moebit_fp32") or from_pretrained(str(folder)),
                            tmp / f"{name}-gguf", args.threads, args.prompt + args.new_tokens + 8)
    for b in args.batch:
        prompts = prompts_of(b, args.prompt)
        runners: dict[str, Any] = {}
        if not args.no_transformers:
            runners["transformers"] = _hf_runner(hf, prompts)
        runners.update({k: (lambda n, m=m, p=prompts, k=k: _moebit_run(m, p, n,
                                                                        a8=k.endswith(A8)))
                        for k, m in models.items()})
        if args.modules:  # the same models, each step through the torch modules
            runners.update({k + MODULES: (lambda n, m=m, p=prompts: _moebit_run(m, p, n, False))
                            for k, m in models.items() if not k.endswith(A8)})
        if peer is not None and b == 1:
            runners.update(peer.runners(prompts[0]))
        res[f"b{b}"] = _rows(time_batch(runners, args.new_tokens, args.reps), res["floors"], b)
        print(f"{name} batch {b}: " + json.dumps({k: r["ms_per_step"] for k, r in
                                                 res[f"b{b}"].items()}),
              file=sys.stderr, flush=True)  # progress: a long run shows each batch's row
    if peer is not None:
        peer.close()
    del hf, models
    gc.collect()
    return res


def _rows(timed: dict[str, Any], floor: dict[str, dict[str, float]], b: int) -> dict[str, Any]:
    """Per variant: ms/step, tokens/s, vs its floor (batch 1), vs transformers; agreement
    of greedy tokens (first prompt) with moebit fp32."""
    ms, toks = timed["ms"], timed["tokens"]
    rows: dict[str, Any] = {}
    for k, v in ms.items():
        row: dict[str, Any] = {"variant": k, "ms_per_step": v,
                               "tokens_per_s": round(1e3 * b / v, 1)}
        sch = floor.get(_scheme_of(k))
        if sch is not None and b == 1:  # the floor counts one token's k experts
            row["floor_ms"] = sch["floor_ms"]
            row["x_floor"] = round(v / sch["floor_ms"], 2)
        if "transformers" in ms and k != "transformers":
            row["speedup_vs_transformers"] = round(ms["transformers"] / v, 2)
        if "moebit_fp32" in toks and k != "moebit_fp32":
            row["agree_with_moebit_fp32"] = agreement(toks["moebit_fp32"], toks[k])
        rows[k] = row
    for mb, peer in (("moebit_fp32", "llamacpp_F32"), ("moebit_int8", "llamacpp_Q8_0"),
                     ("moebit_int8_all", "llamacpp_Q8_0"), ("moebit_int8_all_a8", "llamacpp_Q8_0"),
                     ("moebit_int4", "llamacpp_Q4_0"),
                     ("moebit_int4_all", "llamacpp_Q4_0"), ("moebit_int4_all_a8", "llamacpp_Q4_0")):
        if mb in ms and peer in ms:
            rows[mb][f"tokens_per_s_vs_{peer}"] = round(ms[peer] / ms[mb], 4)
    return rows


def fastest_row_rate(res: dict[str, Any]) -> float:
    """The fastest rate any batch-1 row read its weights at (its weight bytes over its
    ms per step), GB/s: what the machine demonstrably did during the run."""
    best = 0.0
    for c in res["configs"].values():
        for row in c.get("b1", {}).values():
            f = c["floors"].get(_scheme_of(row["variant"]))
            if f is not None:
                best = max(best, f["weight_bytes"] / (row["ms_per_step"] * 1e6))
    return round(best, 2)


def refloor(res: dict[str, Any], gb_s: float) -> None:
    """Every floor at ``gb_s``: the fastest rate seen in the run, of the read probes
    (before the run and after each configuration) and of the rows themselves. A host's
    bandwidth moves over minutes; a floor from a slow moment would flatter every row (a
    row faster than its 'floor'), so each ratio is taken against the best rate seen."""
    res["floor_gb_s"] = gb_s
    for c in res["configs"].values():
        for f in c["floors"].values():
            f["floor_ms"] = round(fl.floor_ms(f["weight_bytes"], gb_s), 3)
        for row in c.get("b1", {}).values():
            if "floor_ms" in row:
                row["floor_ms"] = c["floors"][_scheme_of(row["variant"])]["floor_ms"]
                row["x_floor"] = round(row["ms_per_step"] / row["floor_ms"], 2)


def table(res: dict[str, Any]) -> str:
    """The human-readable summary: one line per (config, batch, variant)."""
    probes = " / ".join(str(x) for x in res.get("bandwidth_probes_gb_s", []))
    lines = [f"floors at {res.get('floor_gb_s', res['bandwidth']['best_gb_s'])} GB/s, the "
             f"fastest of the read probes ({probes}: before, after each config) and the "
             f"rows ({res.get('rows_best_gb_s', '-')}); "
             f"({res['threads']} threads; load "
             f"{res['loadavg_before'][0]:.1f} / {res['loadavg_after'][0]:.1f}); "
             f"{res['cpu']} ({res['isa']})",
             f"{'config':6} {'batch':>5} {'variant':16} {'ms/step':>9} {'tok/s':>8} "
             f"{'floor ms':>9} {'x floor':>8} {'vs HF':>6} {'vs peer':>8} {'agree':>8}"]
    for cname, c in res["configs"].items():
        for bk in (k for k in c if k.startswith("b") and k[1:].isdigit()):
            for v, r in c[bk].items():
                peer = next((x for k, x in r.items() if k.startswith("tokens_per_s_vs_")), "")
                ag = r.get("agree_with_moebit_fp32")
                lines.append(
                    f"{cname:6} {bk[1:]:>5} {v:16} {r['ms_per_step']:9.2f} "
                    f"{r['tokens_per_s']:8.1f} {r.get('floor_ms', ''):>9} "
                    f"{r.get('x_floor', ''):>8} {r.get('speedup_vs_transformers', ''):>6} "
                    f"{peer:>8} {'' if ag is None else str(ag['prefix']) + '/' + str(ag['of']):>8}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moebit bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["e8", "e64"], choices=sorted(CONFIGS))
    ap.add_argument("--variants", nargs="+", default=list(MOEBIT_VARIANTS),
                    choices=list(MOEBIT_VARIANTS), help="moebit's expert formats")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bandwidth-mb", type=int, default=1024,
                    help="buffer of the read-bandwidth measurement (MB)")
    ap.add_argument("--kv-cache", choices=tuple(KV_CACHE_DTYPES), default=None,
                    help="moebit's key/value cache (default float32; llama.cpp's is float16)")
    ap.add_argument("--peer", choices=("none", "llamacpp"), default="none")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--modules", action="store_true",
                    help="also time every moebit variant through its torch modules "
                         "(rows suffixed _modules): the native one-call step's gain")
    ap.add_argument("--workdir", help="where the folders and GGUF files go (default: a "
                    "temporary folder, removed)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.prompt < 1 or min(args.batch) < 1:
        raise ValueError("--new-tokens must be >= 2, --prompt and --batch >= 1")
    torch.set_num_threads(args.threads)
    bw = fl.read_bandwidth(args.threads, args.bandwidth_mb)
    res: dict[str, Any] = {"args": vars(args), "torch": torch.__version__,
                           "cpu": cpu_model() or platform.processor(), "isa": select_isa(),
                           "threads": args.threads, "bandwidth": bw,
                           "loadavg_before": os.getloadavg(), "configs": {}}
    probes = [bw]
    with tempfile.TemporaryDirectory(prefix="moebit-bench-decode-", dir=args.workdir) as tmp:
        for name in args.configs:
            res["configs"][name] = run_config(name, args, bw["best_gb_s"], Path(tmp))
            probes.append(fl.read_bandwidth(args.threads, args.bandwidth_mb))
    res["bandwidth_after"] = probes[-1]
    res["bandwidth_probes_gb_s"] = [p["best_gb_s"] for p in probes]
    res["rows_best_gb_s"] = fastest_row_rate(res)
    refloor(res, max(*res["bandwidth_probes_gb_s"], res["rows_best_gb_s"]))
    res["loadavg_after"] = os.getloadavg()
    print(table(res))
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0
