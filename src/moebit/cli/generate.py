"""``moebit generate``: text from a trained run, on one rank or N (expert- and data-parallel).

    moebit generate runs/a --prompt "def " --prompt "class " --max-new-tokens 200
    moebit generate runs/a --prompt "def " --temperature 0            # greedy
    moebit generate runs/a --prompts-file prompts.txt --batch 32 --nproc 2 --quantize int8
    moebit generate path/to/hf-model --prompt "def " --temperature 0  # a Hugging Face folder

A Hugging Face folder (or a run trained ``--init-from`` one) decodes through its
``tokenizer.json`` (text in, text out); moebit's GPT decodes bytes.

With ``--nproc N`` the ranks are launched through torch.distributed.run, each re-running
this module with ``--worker``: the prompts are split across ranks, and an MoE model's
experts are split over ``--ep-size`` ranks (default N when every MoE layer's expert count
divides by N), each rank holding E/ep of every layer and serving them to all ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moebit.checkpoint import CheckpointError, read_manifest
from moebit.cli.args import add_kv_cache_flag
from moebit.cli.launch import run_ranks
from moebit.comm.collectives import init_from_env
from moebit.inference import fused_decode
from moebit.inference.generate import eos_token_ids, generate_tokens
from moebit.inference.loading import init_folder_of, load_model, model_config_of, resolve_checkpoint
from moebit.inference.quantize_dense import SCOPES, quantize_model_
from moebit.models.hf.config import DENSE_FAMILIES, FAMILIES
from moebit.models.hf.folder import check_folder, looks_like_hf_folder
from moebit.models.hf.tokens import TOKENIZER_FILE, load_tokenizer
from moebit.models.kv_cache import set_kv_dtype
from moebit.models.registry import family_of, family_of_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                    help="a run folder (its newest checkpoint) or RUN/checkpoints/step-N")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--prompts-file", help="a text file with one prompt per line")
    ap.add_argument("--max-new-tokens", type=int, default=120)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    ap.add_argument("--top-k", type=int, default=40, help="0 keeps every byte")
    ap.add_argument("--batch", type=int, default=32, help="prompts decoded together per rank")
    ap.add_argument("--stop", help="end a text once it ends with this string (e.g. '\\n\\n')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=1, help="ranks on this machine")
    ap.add_argument("--ep-size", type=int, default=0,
                    help="expert-parallel ranks (default: --nproc when the experts divide by it)")
    ap.add_argument("--quantize", choices=("none", "int8", "int4"), default="none",
                    help="int8: weight-only int8 (per-output-channel scales); int4: one "
                         "scale per 32 weights; what is quantized: --quantize-scope")
    ap.add_argument("--activations", choices=("float32", "int8"), default="float32",
                    help="int8: with --quantize int4 or int8, the native decode step multiplies "
                         "the quantized weights by activations rounded to 8 bits per 32 "
                         "(faster; llama.cpp's Q4_0 / Q8_0 x Q8_0 arithmetic)")
    ap.add_argument("--quantize-scope", choices=SCOPES, default="all",
                    help="all: experts and the dense projections (attention, dense MLPs, "
                         "head); experts: the experts only")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                    help="weights and activations of the whole model")
    add_kv_cache_flag(ap)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    ap.add_argument("--json", help="also write prompts, texts and timings to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        p = Path(args.prompts_file)
        if not p.is_file():
            raise ValueError(f"--prompts-file {str(p)!r}: no such file")
        from_file = [line.replace("\\n", "\n") for line in p.read_text().splitlines() if line]
        if not from_file:
            raise ValueError(f"--prompts-file {str(p)!r} holds no prompts (one per non-empty line)")
        prompts += from_file
    if not prompts:
        raise ValueError("give at least one --prompt (or --prompts-file)")
    return prompts


def _check(args: argparse.Namespace) -> int:
    """Validate flags and the checkpoint before any rank starts; returns the ep size to use."""

    for name in ("max_new_tokens", "top_k", "ep_size", "threads"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.batch < 1 or args.nproc < 1:
        raise ValueError("--batch and --nproc must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    cfg, d, tok = _source(args.checkpoint)
    if tok is not None and args.stop:
        raise ValueError("--stop compares bytes: it works with byte-level models only")
    if tok is None:  # byte-level: the window is counted in the prompt's bytes
        for line in window_warnings(_prompts(args), args.max_new_tokens, cfg.block_size):
            print(f"moebit generate: warning: {line}", file=sys.stderr)
    counts = family_of(cfg).pattern(cfg).expert_counts
    if args.activations == "int8" and args.quantize == "none":
        raise ValueError("--activations int8 rounds the activations quantized weights meet: "
                         "it needs --quantize int4 or int8, got --quantize none")
    if args.quantize != "none" and args.quantize_scope == "experts" and not counts:
        raise ValueError(f"--quantize {args.quantize} --quantize-scope experts: {d} holds a "
                         f"dense model (no experts; --quantize-scope all quantizes its "
                         f"projections)")
    ep = args.ep_size
    if ep == 0:
        ep = args.nproc if counts and all(e % args.nproc == 0 for e in counts) else 1
    if ep > 1:
        if not counts:
            raise ValueError(f"--ep-size {ep}: {d} holds a dense model (no experts to split)")
        if args.nproc % ep or any(e % ep for e in counts):
            raise ValueError(f"--ep-size {ep} must divide --nproc {args.nproc} and every MoE "
                             f"layer's expert count {counts}")
    return ep


def window_warnings(prompts: list[str], max_new_tokens: int, block_size: int) -> list[str]:
    """What the fixed context window will do to these prompts, said before it happens: a
    prompt longer than the window is cut to its end, and a text stops when the window is
    full (prompt + new bytes <= block_size)."""
    lengths = [len(p.encode("utf-8")) for p in prompts]
    out = []
    cut = [i for i, n in enumerate(lengths) if n > block_size - 1]
    if cut:
        out.append(f"{len(cut)} prompt(s) longer than the model's context (block size {block_size}) "
                   f"are cut to their last {block_size - 1} bytes (first: prompt {cut[0] + 1}, "
                   f"{lengths[cut[0]]} bytes)")
    room = min(block_size - min(n, block_size - 1) for n in lengths)
    if max_new_tokens > room:
        out.append(f"--max-new-tokens {max_new_tokens}: with block size {block_size}, texts stop "
                   f"when prompt + new bytes fill the window (as few as {room} new bytes here)")
    return out
HF_MODEL_TYPES = FAMILIES + DENSE_FAMILIES


def _hf_checked(path: str) -> bool:
    """A Hugging Face folder (of a family moebit reads, or of none): check it whole first."""
    fam = family_of_folder(path)
    return looks_like_hf_folder(path) and (fam is None or fam.name in HF_MODEL_TYPES)


def _source(path: str) -> tuple[Any, Path, Path | None]:
    """(model config, folder, tokenizer.json or None) of a run, a checkpoint or a Hugging
    Face folder; a run trained ``--init-from`` an HF folder decodes with its tokenizer."""
    if _hf_checked(path):  # checked whole first: a corrupt folder is one named error
        check_folder(path, tokenizer="required")
    fam = family_of_folder(path)
    if fam is not None:
        tok = Path(path) / TOKENIZER_FILE
        return fam.read_folder_config(Path(path)), Path(path), tok if tok.is_file() else None
    d = resolve_checkpoint(path)
    manifest = read_manifest(d)
    init = init_folder_of(manifest)
    tok = init / TOKENIZER_FILE if init is not None else None
    return model_config_of(manifest, d), d, tok if tok is not None and tok.is_file() else None


def _load(path: str, ep: int, rank: int) -> torch.nn.Module:
    fam = family_of_folder(path)
    if fam is not None:
        return fam.load_folder(fam.read_folder_config(Path(path), ep), Path(path)).eval()
    return load_model(path, ep_size=ep, rank=rank)


def _run_rank(args: argparse.Namespace, ep: int) -> int:

    if ep < 0:  # a launched rank: the parent checked everything
        ep = args.ep_size
    info = init_from_env("cpu")
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // info.world_size))
    try:
        t0 = time.perf_counter()
        model = _load(args.checkpoint, ep, info.rank)
        tok_path = _source(args.checkpoint)[2]
        tok = load_tokenizer(tok_path) if tok_path is not None else None
        reports = []
        if args.quantize != "none":  # before the cast: the report compares with float32 weights
            reports = quantize_model_(model, int(args.quantize[3:]), args.quantize_scope)
        if DTYPES[args.dtype] != torch.float32:
            model.to(DTYPES[args.dtype])
        set_kv_dtype(model, args.kv_cache)
        if args.activations == "int8":
            fused_decode.use_int8_activations(model)
        load_s = time.perf_counter() - t0
        prompts = _prompts(args)
        res = generate_tokens(
            model, [_encode(tok, p) for p in prompts], args.max_new_tokens,
            args.temperature, args.top_k or None, args.seed, args.batch,
            args.stop.encode("utf-8") if args.stop else None,
            eos=eos_token_ids(model.config,
                              args.checkpoint if family_of_folder(args.checkpoint) else None),
        )
        if info.is_main:
            texts = [_decode(tok, t) for t in res.tokens]
            for p, t in zip(prompts, texts, strict=True):
                print(p + t)
                print("-" * 40)
            n_new = sum(len(t) for t in res.tokens)
            busy = res.prefill_s + res.decode_s
            summary = {
                "ranks": info.world_size, "ep_size": ep, "quantize": args.quantize,
                "dtype": args.dtype, "kv_cache": args.kv_cache or args.dtype,
                "n_prompts": len(prompts), "new_tokens": n_new,
                "load_s": round(load_s, 3), "rank0_prefill_s": round(res.prefill_s, 3),
                "rank0_decode_s": round(res.decode_s, 3),
                "rank0_ms_per_step": round(1e3 * res.decode_s / max(1, res.decode_steps), 2),
                "tokens_per_s": round(n_new / busy, 1) if busy else None,
            }
            if reports:
                summary["quantize_scope"] = args.quantize_scope
                summary["activations"] = args.activations
                summary["quantized"] = "; ".join(map(str, reports))
            print(json.dumps(summary), file=sys.stderr)
            if args.json:
                Path(args.json).write_text(json.dumps(
                    {"prompts": prompts, "texts": texts, **summary}, indent=2) + "\n")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _encode(tok: Any, text: str) -> list[int]:
    return list(text.encode("utf-8")) if tok is None else tok.encode(text, add_special_tokens=False).ids


def _decode(tok: Any, ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace") if tok is None else tok.decode(ids)


ARGS_ENV = "MOEBIT_GENERATE_ARGS"


def _launch(args: argparse.Namespace, ep: int) -> int:
    """Start --nproc ranks; the settings travel as JSON in the environment, not as argv,
    where torchrun's parser would take ``--nproc`` for its own ``--nproc-per-node``."""
    os.environ[ARGS_ENV] = json.dumps({**vars(args), "ep_size": ep, "worker": True})
    run_ranks({"nproc": args.nproc}, "moebit.cli.generate", ["--worker"], "generation")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--worker"]:  # a rank started by _launch
        return _run_rank(argparse.Namespace(**json.loads(os.environ[ARGS_ENV])), -1)
    args = parser().parse_args(argv)
    try:
        _prompts(args)
        ep = _check(args)
        if args.nproc == 1:
            return _run_rank(args, ep)
        return _launch(args, ep)
    except (CheckpointError, ValueError) as e:
        print(f"moebit generate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
