"""``moebit serve``: an OpenAI-compatible HTTP server with continuous batching.

    moebit serve runs/a --port 8000                                  # one process
    moebit serve runs/a --port 8000 --nproc 2 --ep-size 2 --quantize int8
    curl -s 127.0.0.1:8000/v1/completions -d '{"prompt": "def ", "max_tokens": 32}'

With ``--nproc N`` the ranks are launched through torch.distributed.run; rank 0 serves
HTTP and holds every request, all ranks step in lockstep and hold E/ep experts each.
See docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moebit.checkpoint import CheckpointError, read_manifest
from moebit.cli.args import add_kv_cache_flag
from moebit.cli.launch import run_ranks
from moebit.comm.collectives import init_from_env
from moebit.inference import fused_decode
from moebit.inference.generate import eos_token_ids
from moebit.inference.loading import init_folder_of, load_model, model_config_of, resolve_checkpoint
from moebit.inference.quantize_dense import SCOPES, quantize_model_
from moebit.models.hf.config import DENSE_FAMILIES, FAMILIES
from moebit.models.hf.folder import check_folder, looks_like_hf_folder
from moebit.models.kv_cache import set_kv_dtype
from moebit.models.registry import family_of, family_of_folder
from moebit.serve.engine import ENGINES, check_knobs
from moebit.serve.server import PortInUse, bind, follow, serve_main

HF_MODEL_TYPES = FAMILIES + DENSE_FAMILIES
HF_CONTEXT = 2048  # KV-cache columns per slot for a Hugging Face model, unless --context

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ARGS_ENV = "MOEBIT_SERVE_ARGS"
COLLECTIVE_TIMEOUT_S = 60.0  # a dead rank becomes an error (then 503s and exit 1) this fast


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", metavar="RUN|CHECKPOINT|HF_DIR",
                    help="a run folder (its newest checkpoint) or RUN/checkpoints/step-N")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-name", help="the model's id in the API (default: the path given)")
    ap.add_argument("--max-batch", type=int, default=32, help="KV-cache slots: requests decoded together")
    ap.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot; more get 429")
    ap.add_argument("--max-batch-tokens", type=int, default=256,
                    help="tokens in one step's forward: a token of each decoding request, "
                         "then prompt chunks (a long prompt is split over steps)")
    ap.add_argument("--prefix-cache-tokens", type=int, default=4096,
                    help="prompt-prefix keys/values kept for reuse, in tokens (LRU; 0: off)")
    ap.add_argument("--engine", choices=ENGINES, default="ragged",
                    help="ragged: one packed forward per step; legacy: a decode and a "
                         "prefill forward per step (--prefill-chunk)")
    ap.add_argument("--prefill-chunk", type=int, default=128,
                    help="--engine legacy: prompt tokens prefilled per step, over all requests")
    ap.add_argument("--nproc", type=int, default=1, help="ranks on this machine")
    ap.add_argument("--ep-size", type=int, default=0, help="expert-parallel ranks (default --nproc)")
    ap.add_argument("--quantize", choices=("none", "int8", "int4"), default="none",
                    help="weight-only int8 (per-channel scales) or int4 (per 32 weights)")
    ap.add_argument("--activations", choices=("float32", "int8"), default="float32",
                    help="int8: with --quantize int4 or int8, the native decode step multiplies "
                         "the quantized weights by activations rounded to 8 bits per 32 "
                         "(faster; llama.cpp's Q4_0 / Q8_0 x Q8_0 arithmetic)")
    ap.add_argument("--quantize-scope", choices=SCOPES, default="all",
                    help="all: experts and the dense projections (attention, dense MLPs, "
                         "head); experts: the experts only")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    add_kv_cache_flag(ap)
    ap.add_argument("--context", type=int, default=0,
                    help="tokens of context per request (KV-cache columns per slot); 0: the "
                         f"model's block size, or {HF_CONTEXT} for a Hugging Face folder")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    ap.add_argument("--log-level", default="warning", help="uvicorn's log level")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def _hf_checked(path: str) -> bool:
    """A Hugging Face folder (of a family moebit reads, or of none): check it whole first."""
    fam = family_of_folder(path)
    return looks_like_hf_folder(path) and (fam is None or fam.name in HF_MODEL_TYPES)


def check(args: argparse.Namespace) -> int:
    """Validate flags and the checkpoint before any rank starts; the ep size to use."""
    if args.nproc < 1:
        raise ValueError("--nproc must be >= 1")
    check_knobs(args.max_batch, args.max_queue, args.prefill_chunk, args.max_batch_tokens,
                args.prefix_cache_tokens, args.engine)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} must lie in 1..65535")
    if args.context < 0:
        raise ValueError("--context must be >= 0 (0: the model's own)")
    if not args.worker:
        bind(args.host, args.port).close()  # PortInUse now, before loading any model
    if _hf_checked(args.checkpoint):  # checked whole first: one named error, no traceback
        check_folder(args.checkpoint, tokenizer="required")
    fam = family_of_folder(args.checkpoint)
    if fam is not None:
        cfg = fam.read_folder_config(Path(args.checkpoint))
        d = args.checkpoint
    else:
        d = resolve_checkpoint(args.checkpoint)
        cfg = model_config_of(read_manifest(d), d)
        fam = family_of(cfg)
    counts = fam.pattern(cfg).expert_counts
    if args.activations == "int8" and args.quantize == "none":
        raise ValueError("--activations int8 rounds the activations quantized weights meet: "
                         "it needs --quantize int4 or int8, got --quantize none")
    if args.quantize != "none" and args.quantize_scope == "experts" and not counts:
        raise ValueError(f"--quantize {args.quantize} --quantize-scope experts: {d} holds a "
                         f"dense model (no experts; --quantize-scope all quantizes its "
                         f"projections)")
    ep = args.ep_size or args.nproc
    if ep != args.nproc:
        raise ValueError(f"--ep-size {ep} must equal --nproc {args.nproc}: rank 0 holds every "
                         "request and the other ranks serve their experts")
    if ep > 1 and (not counts or any(e % ep for e in counts)):
        raise ValueError(f"--ep-size {ep} must divide every MoE layer's expert count {counts}")
    return ep


def load_for_serving(args: argparse.Namespace, rank: int) -> tuple[torch.nn.Module, object]:
    """The model (a moebit run or a model folder) and the tokenizer it reads and writes."""
    folder = Path(args.checkpoint)
    fam = family_of_folder(folder)
    if fam is None:
        model = load_model(args.checkpoint, ep_size=args.ep_size or 1, rank=rank)
        if args.context:
            model.config.block_size = min(args.context, model.config.block_size)
        # a run trained --init-from a folder reads and writes that folder's token ids
        init = init_folder_of(read_manifest(resolve_checkpoint(args.checkpoint)))
        return model, family_of(model.config).tokenizer(init)
    model = fam.load_folder(fam.read_folder_config(folder, args.ep_size or 1), folder).eval()
    limit = model.config.max_position_embeddings
    model.config.block_size = min(args.context or HF_CONTEXT, limit)
    return model, fam.tokenizer(folder)


def run_rank(args: argparse.Namespace) -> int:
    info = init_from_env("cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // info.world_size))
    try:
        model, tokenizer = load_for_serving(args, info.rank)
        if args.quantize != "none":
            quantize_model_(model, int(args.quantize[3:]), args.quantize_scope)
        if DTYPES[args.dtype] != torch.float32:
            model.to(DTYPES[args.dtype])
        set_kv_dtype(model, args.kv_cache)
        if args.activations == "int8":
            fused_decode.use_int8_activations(model)
        if info.rank != 0:
            return follow(model)
        hf_dir = args.checkpoint if family_of_folder(args.checkpoint) is not None else None
        return serve_main(model, tokenizer, args.model_name or args.checkpoint, args.host,
                          args.port, args.max_batch, args.max_queue, args.prefill_chunk,
                          lockstep=info.world_size > 1, log_level=args.log_level,
                          eos=eos_token_ids(model.config, hf_dir),
                          engine={"max_batch_tokens": args.max_batch_tokens,
                                  "prefix_cache_tokens": args.prefix_cache_tokens,
                                  "engine": args.engine})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--worker"]:  # a rank started below through torchrun
        code = run_rank(argparse.Namespace(**json.loads(os.environ[ARGS_ENV])))
        sys.exit(code)
    args = parser().parse_args(argv)
    try:
        args.ep_size = check(args)
    except (CheckpointError, ValueError, PortInUse) as e:
        print(f"moebit serve: error: {e}", file=sys.stderr)
        return 2
    if args.nproc == 1:
        return run_rank(args)
    # settings travel as JSON in the environment: torchrun's parser would take --nproc
    os.environ[ARGS_ENV] = json.dumps({**vars(args), "worker": True})
    drain_ranks_on_signal()
    run_ranks({"nproc": args.nproc, "signals_to_handle": "SIGHUP,SIGQUIT"}, "moebit.cli.serve",
              ["--worker"], "serving")
    return 0


def _children() -> list[int]:
    """This process's child processes (the ranks torchrun started), from /proc."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me:
            out.append(int(d.name))
    return out


def drain_ranks_on_signal() -> None:
    """SIGTERM/SIGINT on the launcher drain the server instead of killing the ranks.

    torchrun's agent would answer the signal by terminating every rank (and SIGKILL after
    30 s): the followers would die under rank 0 and the launcher would exit 143. Instead
    torchrun is told to leave those two signals alone (``signals_to_handle``), and this
    handler passes SIGTERM on to the ranks: rank 0 drains its requests and then tells the
    others to stop (they ignore the signal), so every rank exits 0 and so does the
    launcher, through torchrun's normal ending.
    """

    def forward(_sig: int, _frame: object) -> None:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)


if __name__ == "__main__":
    sys.exit(main())
