"""``moebit plan``: predict step time, run time and bytes of a training setup on a cluster.

    moebit plan --model bert-large --cluster tang2021-ethernet --optimizers adam,onebit_adam \\
        --micro-batch 16 --seq-len 128 --steps 100000 --freeze-step 15000 --grad-dtype fp16
    moebit plan --model config.json --nodes 4 --devices-per-node 8 --inter-bw 100gbit \\
        --flops 150e12 --ep-size 8 --optimizers adam,onebit_adam,zero_one_adam --plot out/
    moebit plan --model run.toml --calibrate --devices-per-node 2 --json plan.json

Bench-compatible (the flags and JSON fields of ``moebit bench train``, predicted):

    moebit plan bench --optimizers adam,onebit_adam --nproc 4 --steps 40 --freeze-step 10 \\
        --measure-from 20 --link 1gbit --calibrate --json pred.json -- --n-layer 2 ...
    moebit plan --validate bench.json --calibrate     # re-predict a measurement, row by row

Per-rank memory, replicated and sharded (``moebit.cli.plan_memory``):

    moebit plan memory --nproc 4 --memory-per-rank 2GiB -- --n-layer 12 --d-model 768 --shard fsdp
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from moebit.plan import calibrate as cal
from moebit.plan.benchmode import bench_predict, compare_rows, freeze_of, parse_train_flags
from moebit.plan.cluster import ClusterSpec, load_cluster, parse_bandwidth, parse_latency
from moebit.plan.loaders import load_model
from moebit.plan.model import OPTIMIZERS, Setup
from moebit.plan.outer import OUTER_OPTIMIZERS, OuterSetup, compare_all, format_outer
from moebit.plan.report import format_plan, format_validation, plot
from moebit.plan.spec import SpecError

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _plan_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a preset, a moebit .toml/.json config, or an HF config.json")
    ap.add_argument("--cluster", help="a cluster preset or a JSON file of cluster fields")
    c = ap.add_argument_group("cluster (override the preset's fields)")
    for name in ("nodes", "devices_per_node"):
        c.add_argument("--" + name.replace("_", "-"), type=int)
    for name in ("intra_bw", "inter_bw", "intra_lat", "inter_lat"):
        c.add_argument("--" + name.replace("_", "-"))
    for name in ("flops", "pack_rate", "update_rate"):
        c.add_argument("--" + name.replace("_", "-"), type=float)
    c.add_argument("--shared-link", action="store_true", help="every rank shares one link")
    c.add_argument("--calibrate", action="store_true",
                   help="measure this machine's device rates and loopback link first")
    s = ap.add_argument_group("setup")
    s.add_argument("--optimizers", default="adam,onebit_adam")
    s.add_argument("--micro-batch", type=int, help="sequences per device per step")
    s.add_argument("--global-batch", type=int, help="sequences per step over all devices")
    s.add_argument("--grad-accum", type=int, default=1, help="passes per optimizer step")
    s.add_argument("--seq-len", type=int, default=0)
    s.add_argument("--steps", type=int)
    s.add_argument("--freeze-step", type=int, help="default: 20%% of the steps")
    s.add_argument("--ep-size", type=int)
    s.add_argument("--grad-dtype", choices=sorted(_BYTES), default="fp32",
                   help="dtype of averaged gradients (moebit: fp32; DeepSpeed fp16: fp16)")
    s.add_argument("--a2a-dtype", choices=sorted(_BYTES), default="bf16")
    s.add_argument("--hierarchical-a2a", action="store_true")
    s.add_argument("--overlap", type=float, default=0.0,
                   help="share of backward that hides exact allreduces (moebit: 0)")
    o = ap.add_argument_group("outer rows (--optimizers diloco,streaming_diloco)")
    o.add_argument("--outer-every", type=int, default=100, help="H: inner steps per sync")
    o.add_argument("--outer-compress", default="none",
                   help="none|bf16|int8|1bit, or a list (one row each), e.g. none,int8,1bit")
    o.add_argument("--outer-fragments", type=int, default=0,
                   help="F for streaming_diloco (default 4; diloco is 1)")
    o.add_argument("--outer-delay", type=int, default=0,
                   help="D: inner steps a fragment's exchange overlaps")
    o.add_argument("--outer-group", choices=("node", "world"), default="node")
    o.add_argument("--outer-int8-block", type=int, default=256)
    o.add_argument("--outer-onebit-block", type=int, default=256,
                   help="elements per 1-bit scale (0: one scale per chunk)")
    o.add_argument("--outer-shard", choices=("none", "fsdp"), default="none",
                   help="fsdp: each node's ranks shard the parameters (moebit train --shard "
                        "fsdp --outer-group node); the outer step syncs each rank's shards")
    ap.add_argument("--json", help="write the plan here")
    ap.add_argument("--plot", metavar="DIR", help="write speedup plots (PNG) here")
    ap.add_argument("--validate", metavar="BENCH_JSON",
                    help="compare a `moebit bench train` JSON with predictions, row by row")
    ap.add_argument("--calibration", metavar="FILE", help="rates saved by an earlier --calibrate")
    ap.add_argument("--save-calibration", metavar="FILE")
    ap.add_argument("--compute-from-first", action="store_true",
                    help="with --validate: take the device rate from the first measured row's "
                         "non-communication time (the host's load at that moment) instead of "
                         "the calibrated step, and scale the CPU-bound rates (packing, "
                         "loopback) by the same factor; the other rows stay predictions")
    ap.add_argument("--papers", action="store_true",
                    help="print the model against the papers' published figures")
    return ap


def _bench_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moebit plan bench",
                                 description="moebit bench train's flags, predicted")
    ap.add_argument("--optimizers", default="adam,onebit_adam")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--freeze-step", default=None)
    ap.add_argument("--measure-from", type=int, default=None)
    ap.add_argument("--link", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--calibration", metavar="FILE")
    ap.add_argument("--save-calibration", metavar="FILE")
    for ignored in ("--limit",):
        ap.add_argument(ignored, action="store_true", help="accepted; not predicted")
    for ignored in ("--seed", "--out", "--timeout"):
        ap.add_argument(ignored, help="accepted for compatibility; no effect on a prediction")
    return ap


def _optimizers(text: str, outer: bool = False) -> list[str]:
    opts = [o.strip() for o in text.split(",") if o.strip()]
    known = OPTIMIZERS + (OUTER_OPTIMIZERS if outer else ())
    bad = [o for o in opts if o not in known]
    if not opts or bad:
        raise SpecError(f"--optimizers: {bad or text!r} not among {', '.join(known)}")
    return opts


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _calibration(args: argparse.Namespace, world: int, cfg: Any = None) -> dict[str, Any] | None:
    if args.calibration:
        p = Path(args.calibration)
        if not p.is_file():
            raise SpecError(f"--calibration {args.calibration!r}: no such file")
        calib = json.loads(p.read_text())
        if cfg is not None and "model_step_s" not in calib:
            raise SpecError(f"--calibration {args.calibration!r}: no model_step_s (calibrate "
                            "with the same train flags)")
    elif args.calibrate:
        print("calibrating on this machine...", file=sys.stderr, flush=True)
        calib = cal.calibrate(max(2, world), cfg, procs=world)
    else:
        return None
    if args.save_calibration:
        Path(args.save_calibration).write_text(json.dumps(calib, indent=2))
    return calib


def _cluster(args: argparse.Namespace, calib: dict[str, Any] | None) -> ClusterSpec:
    c = load_cluster(args.cluster)
    kw: dict[str, Any] = {}
    if calib is not None:
        if args.cluster is None:
            kw.update(name="this machine (calibrated)", intra_bw=calib["link_beta"],
                      inter_bw=calib["link_beta"], intra_lat=calib["link_alpha"],
                      inter_lat=calib["link_alpha"])
        kw.update(flops=calib["matmul_flops"], pack_rate=calib["pack_rate"],
                  update_rate=calib["update_rate"])
    for name in ("nodes", "devices_per_node", "flops", "pack_rate", "update_rate"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    for name in ("intra_bw", "inter_bw"):
        if getattr(args, name) is not None:
            kw[name] = parse_bandwidth(getattr(args, name), f"cluster.{name}")
    for name in ("intra_lat", "inter_lat"):
        if getattr(args, name) is not None:
            kw[name] = parse_latency(getattr(args, name), f"cluster.{name}")
    if args.shared_link:
        kw["shared_link"] = True
    return c.with_(**kw) if kw else c


# flags whose 0 (or less) would silently mean "the default" or divide by zero
_POSITIVE = ("micro_batch", "global_batch", "grad_accum", "steps", "freeze_step", "ep_size",
             "nodes", "devices_per_node")


def check_flags(args: argparse.Namespace, names: tuple[str, ...] = _POSITIVE) -> None:
    """Each given count is >= 1 (and --seq-len >= 0, 0 being the model's): an error names
    the flag instead of a 0 becoming a default or a ZeroDivisionError."""
    for name in names:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise SpecError(f"--{name.replace('_', '-')} must be >= 1 (got {v})")
    if getattr(args, "seq_len", 0) < 0:
        raise SpecError(f"--seq-len must be >= 0, 0 meaning the model's (got {args.seq_len})")


def _setup(args: argparse.Namespace, cluster: ClusterSpec, cfg: Any) -> Setup:
    micro = args.micro_batch
    if args.global_batch is not None:
        if micro is not None:
            raise SpecError("setup: give --micro-batch or --global-batch, not both")
        per = cluster.world * args.grad_accum
        if args.global_batch % per:
            raise SpecError(f"setup.global_batch: {args.global_batch} is not a multiple of "
                            f"devices x grad_accum = {per}")
        micro = args.global_batch // per
    steps = args.steps if args.steps is not None else (cfg.steps if cfg else 1000)
    freeze = args.freeze_step
    if freeze is None and cfg is not None and isinstance(cfg.freeze_step, int):
        freeze = cfg.freeze_step
    if micro is None:
        micro = cfg.batch_size if cfg else 16
    ep = args.ep_size if args.ep_size is not None else (cfg.moe.ep_size if cfg and cfg.moe else 1)
    return Setup(micro_batch=micro, seq_len=args.seq_len,
                 grad_accum=args.grad_accum, steps=steps, freeze_step=freeze, ep_size=ep,
                 grad_bytes=_BYTES[args.grad_dtype], a2a_bytes=_BYTES[args.a2a_dtype],
                 hierarchical_a2a=args.hierarchical_a2a, overlap=args.overlap)


def _write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=2, default=_json_default))


def _json_default(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def run_plan(argv: list[str]) -> int:
    args = _plan_parser().parse_args(argv)
    if args.validate:
        return run_validate(args)
    if args.papers:
        from moebit.plan.papers import format_papers, moe_vs_dense, speedups, table1

        print(format_papers())
        _write_json(args.json, {"table1": table1(), "speedups": speedups(),
                                "moe_vs_dense": moe_vs_dense()})
        return 0
    if not args.model:
        raise SpecError("--model: required (a preset, a moebit config or an HF config.json)")
    check_flags(args)
    model, cfg = load_model(args.model)
    calib = _calibration(args, args.devices_per_node or 2)
    cluster = _cluster(args, calib)
    setup = _setup(args, cluster, cfg)
    opts = _optimizers(args.optimizers, outer=True)
    outer = OuterSetup(args.outer_every, "none", args.outer_fragments, args.outer_delay,
                       args.outer_group, args.outer_int8_block, args.outer_shard,
                       args.outer_onebit_block)
    rows = compare_all(model, cluster, setup, opts, outer, _split(args.outer_compress))
    print(format_plan(rows, model, cluster, setup))
    if any(o in OUTER_OPTIMIZERS for o in opts):
        print("\n" + format_outer(rows))
    doc = {"model": model.summary(), "cluster": cluster.to_dict(), "setup": vars(setup),
           "calibration": calib, "results": rows}
    plain = [o for o in opts if o not in OUTER_OPTIMIZERS]
    if args.plot and plain:  # the sweeps cover the per-step optimizers
        doc["plots"] = plot(model, cluster, setup, plain, args.plot)
        print("plots: " + ", ".join(doc["plots"]))
    _write_json(args.json, doc)
    return 0


def run_bench(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = _bench_parser().parse_args(argv)
    check_flags(args, ("nproc", "steps"))
    opts = _optimizers(args.optimizers)
    measure_from = args.measure_from if args.measure_from is not None else int(0.6 * args.steps)
    cfg = parse_train_flags(extra)
    calib = _calibration(args, args.nproc, cfg)
    if calib is None:
        raise SpecError("moebit plan bench: needs --calibrate or --calibration FILE "
                        "(this machine's rates)")
    doc = bench_predict(opts, args.nproc, args.steps, args.freeze_step, measure_from,
                        args.link, extra, calib)
    from moebit.bench.train import format_table

    for r in doc["results"]:
        r.setdefault("val_loss_vs_first", None)
    print(format_table(doc["results"], args.link) + "\n(predicted)")
    _write_json(args.json, doc)
    return 0


def run_validate(args: argparse.Namespace) -> int:
    p = Path(args.validate)
    if not p.is_file():
        raise SpecError(f"--validate {args.validate!r}: no such file")
    measured = json.loads(p.read_text())
    for key in ("nproc", "steps", "measure_from", "extra", "results"):
        if key not in measured:
            raise SpecError(f"--validate {args.validate!r}: not a bench JSON (no {key!r})")
    cfg = parse_train_flags(measured["extra"])
    calib = _calibration(args, measured["nproc"], cfg)
    if calib is None:
        raise SpecError("--validate: needs --calibrate or --calibration FILE")
    opts = [r["optimizer"] for r in measured["results"] if r["optimizer"] in OPTIMIZERS]
    if args.compute_from_first:
        first = measured["results"][0]
        step = first["step_s"] - first["comm_s_per_step"]
        load = step / float(calib["model_step_s"])  # the host's slowdown since calibrating
        calib = {**calib, "model_step_s": step, "load_factor": load,
                 "pack_rate": calib["pack_rate"] / load, "link_beta": calib["link_beta"] / load,
                 "link_alpha": calib["link_alpha"] * load,
                 "model_step_from": f"measured {first['optimizer']} row (step - comm); "
                                    "packing and loopback rates scaled by the same load factor"}
    predicted = bench_predict(opts, measured["nproc"], measured["steps"], freeze_of(measured),
                              measured["measure_from"], measured["link"], measured["extra"], calib)
    rows = compare_rows(measured, predicted)
    print(format_validation(rows))
    _write_json(args.json, {"measured": str(p), "rows": rows, "prediction": predicted})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "bench":
            return run_bench(argv[1:])
        if argv and argv[0] == "memory":  # per-rank memory, replicated and sharded
            from moebit.cli.plan_memory import run_memory

            return run_memory(argv[1:])
        return run_plan(argv)
    except SpecError as e:
        print(f"moebit plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
