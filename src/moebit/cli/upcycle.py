"""``moebit upcycle``: a dense model becomes an MoE model that starts from its outputs.

A moebit run folder becomes an MoE run folder:

    moebit upcycle runs/dense --num-experts 8 --run-dir runs/upcycled
    moebit upcycle runs/dense --num-experts 8 --moe-every 2 --noise 1e-3 \\
        --set num_experts_per_tok=2 --set bias_update_speed=1e-3 --run-dir runs/up
    moebit train --resume runs/upcycled --steps 600      # 600 counts the dense steps too

A dense Hugging Face folder (Llama, Qwen2, Qwen3, OLMo2) becomes a folder of its MoE
family (Mixtral, Qwen2-MoE, Qwen3-MoE, FlexOlmo) that transformers and ``moebit train
--init-from`` load:

    moebit upcycle path/to/qwen3 --num-experts 8 --num-experts-per-tok 2 --out qwen3-moe/
    moebit upcycle path/to/qwen2 --num-experts 8 --moe-every 2 --shared-expert --out up/

Every expert starts as a copy of its block's dense MLP, the router near zero. With k >= 2
(norm_topk_prob) or softmax_before_topk=false and no dropped tokens, the upcycled run
computes what the dense one did; a Hugging Face folder renormalises its top-k weights
(norm_topk_prob, Mixtral always), so it does at any k (docs/moe-routing.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moebit.checkpoint import CheckpointError
from moebit.models.upcycling import UpcycleSpec
from moebit.training.config import ConfigError
from moebit.upcycle.folders import is_model_folder, upcycle_folder
from moebit.upcycle.runs import upcycle

# flags of the Hugging Face path only (a run sets these through --set)
_HF_ONLY = ("mlp_only_layers", "no_norm_topk_prob", "shared_expert", "router_aux_loss_coef")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit upcycle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", metavar="RUN_OR_HF_DIR",
                    help="dense run folder, RUN/checkpoints/step-N, or a dense Hugging Face folder")
    ap.add_argument("--num-experts", required=True,
                    help="experts per MoE block: E, or (a run) one count per block (E1,E2,...)")
    ap.add_argument("--num-experts-per-tok", type=int, metavar="K",
                    help="experts per token (a Hugging Face folder: default 2; a run: "
                         "the same as --set num_experts_per_tok=K)")
    ap.add_argument("--moe-every", type=int,
                    help="every N-th block becomes an MoE block (a run: default the run's, "
                         "2; a Hugging Face folder: decoder_sparse_step, default 1)")
    ap.add_argument("--noise", type=float, default=0.0, metavar="STD",
                    help="std of Gaussian noise added to each expert's weight matrices")
    ap.add_argument("--router-std", type=float, default=1e-3,
                    help="std of the new routers' weights (near 0: uniform top-k weights)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="(a run) another training-config key of the MoE run, e.g. "
                         "num_experts_per_tok=2 (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the router and expert noise")
    ap.add_argument("--run-dir", "--out", dest="out", required=True, metavar="OUT",
                    help="the new run folder (a run) or Hugging Face folder (a HF folder)")
    hf = ap.add_argument_group("Hugging Face folders only")
    hf.add_argument("--mlp-only-layers", metavar="I,J,...",
                    help="layers that stay dense (Qwen families' mlp_only_layers)")
    hf.add_argument("--no-norm-topk-prob", action="store_true",
                    help="Qwen families, FlexOlmo: do not renormalise the top-k weights (the "
                         "upcycled model then starts away from the dense outputs)")
    hf.add_argument("--shared-expert", action="store_true",
                    help="Qwen2-MoE: the shared expert copies the dense MLP (default: none)")
    hf.add_argument("--router-aux-loss-coef", type=float,
                    help="the config's router_aux_loss_coef (default 0.001)")
    return ap


def _settings(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _hf_spec(args: argparse.Namespace) -> UpcycleSpec:
    """The Hugging Face path's options; run-only flags are errors naming them."""
    if args.set:
        raise ValueError("--set sets training-config keys of a run; a Hugging Face folder "
                         "takes --num-experts-per-tok, --moe-every, --mlp-only-layers, ...")
    if "," in args.num_experts:
        raise ValueError(f"--num-experts {args.num_experts}: a Hugging Face MoE family has "
                         "one expert count for all its MoE layers")
    layers = [int(v) for v in args.mlp_only_layers.split(",")] if args.mlp_only_layers else []
    extra = {} if args.router_aux_loss_coef is None else {
        "router_aux_loss_coef": args.router_aux_loss_coef}
    return UpcycleSpec(
        num_experts=int(args.num_experts), num_experts_per_tok=args.num_experts_per_tok or 2,
        noise_std=args.noise, router_std=args.router_std, moe_every=args.moe_every or 1,
        mlp_only_layers=layers, norm_topk_prob=not args.no_norm_topk_prob,
        shared_expert=args.shared_expert, seed=args.seed, **extra)


def _run_upcycle(args: argparse.Namespace) -> str:
    used = [f"--{n.replace('_', '-')}" for n in _HF_ONLY if getattr(args, n) not in (None, False)]
    if used:
        raise ValueError(f"{', '.join(used)}: for Hugging Face folders only; {args.run} is a "
                         "run (use --set KEY=VALUE)")
    experts: int | list[int] = ([int(v) for v in args.num_experts.split(",")]
                                if "," in args.num_experts else int(args.num_experts))
    settings = _settings(args.set)
    if args.num_experts_per_tok is not None:
        settings["num_experts_per_tok"] = args.num_experts_per_tok
    ckpt = upcycle(args.run, args.out, experts, moe_every=args.moe_every,
                   noise_std=args.noise, router_std=args.router_std,
                   settings=settings, seed=args.seed)
    return f"wrote {ckpt}; continue with: moebit train --resume {args.out} --steps N"


def _hf_upcycle(args: argparse.Namespace) -> str:
    spec = _hf_spec(args)
    out, family = upcycle_folder(args.run, args.out, spec)
    return (f"wrote {out} ({family}, {spec.num_experts} experts, top-{spec.num_experts_per_tok}); "
            f"train it with: moebit train --init-from {out} ...")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.noise < 0 or args.router_std < 0:
        print("moebit upcycle: --noise and --router-std must be >= 0", file=sys.stderr)
        return 2
    try:
        msg = _hf_upcycle(args) if is_model_folder(args.run) else _run_upcycle(args)
    except (CheckpointError, ConfigError, ValueError, KeyError, OSError) as e:
        print(f"moebit upcycle: {e}", file=sys.stderr)
        return 2
    print(f"moebit upcycle: {msg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
