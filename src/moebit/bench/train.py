"""``moebit bench train``: optimizers side by side on real multi-rank training.

Runs ``moebit train`` once per optimizer with the same model, data, seed and steps (all
ranks inside a private namespace whose loopback is shaped to ``--link`` when given), and,
with ``--limit``, the same per-rank work with no communication at all: ``--nproc``
independent single-rank trainings at once, whose summed tokens/s bound what any
communication scheme can reach. Prints and writes (JSON) final validation loss, bytes on
the wire, throughput after the warm-up, and the step-time split into communication and
the rest, each against the first optimizer.

With expert parallelism the limit runs, per rank, the same model with only its own
E / ep_size experts per MoE block and ep_size 1: every rank of the real run computes
that many experts on as many token-expert pairs (its share of the balanced routing), so
the FLOPs per rank match and only the all-to-alls and gradient averages are gone.

``--optimizers adam,diloco,streaming_diloco`` adds DiLoCo rows: the inner optimizer is
``adam`` (torch's AdamW with ``--weight-decay``, as in the adam row) wrapped by
``--outer diloco`` / ``--outer streaming_diloco``. The ``--outer-*`` flags after ``--``
apply only to those rows (the other rows drop them), and they run with
``--outer-group world`` unless given: on one machine every rank is its own worker.

``--two-nodes --link 100mbit`` runs every row on two emulated nodes, half the ranks on
each, only the link between them shaped (``moebit.bench.train_nodes``); rows gain the bytes
that crossed it (``inter_node_bytes``, per token), and outer rows default to
``--outer-group node`` (a worker per node). ``--peers torchft_diloco`` adds torchft's
DiLoCo (``moebit.bench.torchft_peer``); a peer that cannot run fails its row with one line.

``--a2a-dtypes fp32,bf16,int8`` runs each optimizer once per token all-to-all wire format
(forward and backward). ``--peers powersgd,fp16`` adds torch DDP with torch's PowerSGD
hook (rank ``--powersgd-rank``, a list gives one row each) and fp16 hook on the same
model, data and schedule (``moebit.bench.ddp_peer``). ``--target-loss L`` adds the wall
time until the validation loss first reaches L, the headline column when it is given.

    moebit bench train --optimizers adam,onebit_adam --nproc 4 --steps 2000 --out bench-out/conv
    moebit bench train --link 1gbit --limit --nproc 4 --steps 60 --measure-from 30 -- --batch-size 1
    moebit bench train --optimizers adam,onebit_adam --peers powersgd,fp16 --target-loss 2.2 ...
    moebit bench train --optimizers adam,diloco,streaming_diloco -- --outer-every 10 --outer-compress 1bit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from moebit.bench.train_nodes import link_fields, run_on_two_nodes
from moebit.bench.train_shard import (
    cap_bytes,
    format_shard_table,
    parse_shards,
    run_capped,
    shard_fields,
)
from moebit.runs import metrics


def _train_argv(extra: list[str], optimizer: str, nproc: int, steps: int, run_dir: Path,
                freeze: str | None, seed: int) -> list[str]:
    argv = [sys.executable, "-m", "moebit.cli", "train", "--nproc", str(nproc), "--steps",
            str(steps), "--optimizer", optimizer, "--run-dir", str(run_dir), "--seed", str(seed),
            "--samples", "0"]
    if freeze is not None and optimizer not in ("adam", "lamb"):
        argv += ["--freeze-step", freeze]
    return argv + extra


OUTER_ROWS = ("diloco", "streaming_diloco")  # rows that wrap adam in an outer optimizer
_OUTER_SWITCHES = ("--outer-nesterov", "--no-outer-nesterov")  # flags without a value


def without_outer(extra: list[str]) -> list[str]:
    """``extra`` without any ``--outer`` / ``--outer-*`` flag (and its value)."""
    out, skip = [], False
    for a in extra:
        if skip:
            skip = False
        elif a in _OUTER_SWITCHES:
            continue
        elif a == "--outer" or a.startswith("--outer-") or a.startswith("--outer="):
            skip = "=" not in a
        else:
            out.append(a)
    return out


def row_flags(extra: list[str], row: str, group: str = "world") -> tuple[str, list[str]]:
    """The ``--optimizer`` and the flags of one row: an outer row trains adam inside
    ``--outer ROW`` with the outer flags of ``extra`` (``--outer-group GROUP`` unless
    given: world on one machine, node with ``--two-nodes``); any other row drops them."""
    if row not in OUTER_ROWS:
        return row, without_outer(extra)
    flags = _without(extra, "--outer")  # the row says which outer optimizer
    if _flag_value(flags, "--outer-group") is None:
        flags = [*flags, "--outer-group", group]
    return "adam", [*flags, "--outer", row]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return metrics.read_run(run_dir)


def time_to_target(recs: list[dict[str, Any]], target: float | None) -> float | None:
    """Wall seconds at the first evaluation whose validation loss is <= ``target``."""
    if target is None:
        return None
    return next((r["wall"] for r in recs if r["kind"] == "eval" and r["val_loss"] <= target),
                None)


def _split(after: list[dict[str, Any]], log_every: int, steps: int) -> dict[str, float]:
    """Seconds per step spent in each kind of communication over the measured windows."""
    kinds: dict[str, float] = {}
    for r in after:
        for k, v in (r.get("comm_seconds_by_kind") or {}).items():
            kinds[k] = kinds.get(k, 0.0) + v * log_every
    return {k: v / max(1, steps) for k, v in kinds.items()}


def measure(run_dir: Path, measure_from: int, target: float | None = None) -> dict[str, Any]:
    """Throughput and step-time split over the logged windows after ``measure_from``."""
    recs = _records(run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    start = next(r for r in recs if r["kind"] == "start")
    end = next(r for r in reversed(recs) if r["kind"] == "end")
    train = [r for r in recs if r["kind"] == "train"]
    tokens_per_step = cfg["batch_size"] * cfg["block_size"] * start["world_size"]
    before = [r for r in train if r["step"] <= measure_from]
    after = [r for r in train if r["step"] > measure_from]
    if not before or not after:
        raise ValueError(f"{run_dir}: no logged window after step {measure_from}; lower "
                         "--measure-from or --log-every")
    a, b = before[-1], after[-1]
    steps = b["step"] - a["step"]
    seconds = b["train_time"] - a["train_time"]
    overlapped = any(r.get("comm_seconds_per_step") is None for r in after)  # DDP peers
    comm = None if overlapped else (
        sum(r["comm_seconds_per_step"] * cfg["log_every"] for r in after) / max(1, steps))
    split = _split(after, cfg["log_every"], steps)
    step_s = seconds / steps
    return {
        "run": str(run_dir), "optimizer": cfg["optimizer"], "world_size": start["world_size"],
        "n_params": start["n_params"], "val_loss": end["val_loss"],
        "bytes_sent": end["bytes_sent"], "frozen_at": end.get("frozen_at"),
        "tokens_per_s": tokens_per_step * steps / seconds,
        "step_s": step_s, "comm_s_per_step": comm,
        "comm_share": None if comm is None else comm / step_s,
        "a2a_s_per_step": split.get("a2a", 0.0),
        "grad_comm_s_per_step": split.get("exact", 0.0) + split.get("onebit", 0.0),
        "compute_s_per_step": None if comm is None else step_s - comm,
        "step_bytes_by_kind": after[-1].get("step_bytes_by_kind", {}),
        # whole run: DiLoCo's traffic comes once per interval, so a window can miss it
        "bytes_sent_by_kind": end.get("bytes_sent_by_kind", {}),
        "bytes_sent_per_token": end["bytes_sent"] / max(1, cfg["steps"] * tokens_per_step),
        "outer": cfg.get("outer", "none"),
        "time_to_target_s": time_to_target(recs, target),
        "a2a_dtype": cfg.get("a2a_dtype"),
        **link_fields(run_dir, cfg["steps"] * tokens_per_step),  # --two-nodes rows
        **shard_fields(recs, cfg),  # memory, sharded-collective bytes, last loss
    }


def _run(argv: list[str], link: str | None, timeout: float) -> None:
    if link:
        from moebit.bench.netns import run_in_shaped_netns

        proc = run_in_shaped_netns(argv, link, timeout=timeout)
    else:
        proc = subprocess.run(argv, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}): {' '.join(argv)}")


def _flag_value(extra: list[str], flag: str) -> tuple[int, str] | None:
    """Index and value of ``--flag V`` or ``--flag=V`` in ``extra`` (the last one wins)."""
    found = None
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra):
            found = (i, extra[i + 1])
        elif a.startswith(flag + "="):
            found = (i, a.split("=", 1)[1])
    return found


def _without(extra: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in extra:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def limit_extra(extra: list[str]) -> list[str]:
    """The flags of one no-communication rank: with ``--ep-size N``, ep 1 and E / N experts.

    Raises ValueError when the expert count cannot be split that way (it must be given
    as ``--num-experts`` on the command line for the limit to know it).
    """
    ep = _flag_value(extra, "--ep-size")
    if ep is None or int(ep[1]) == 1:
        return extra
    n = int(ep[1])
    experts = _flag_value(extra, "--num-experts")
    if experts is None:
        raise ValueError("--limit with --ep-size needs --num-experts after '--' (the limit "
                         "runs E / ep_size experts per rank)")
    counts = [int(v) for v in experts[1].split(",")]
    if any(c % n for c in counts):
        raise ValueError(f"--num-experts {experts[1]} is not divisible by --ep-size {n}")
    k = _flag_value(extra, "--num-experts-per-tok")
    if k is not None and int(k[1]) > min(counts) // n:
        raise ValueError(f"--limit: k = {k[1]} is more than the {min(counts) // n} experts per "
                         "rank; the no-communication limit cannot route like the real run")
    local = ",".join(str(c // n) for c in counts)
    return _without(_without(extra, "--ep-size"), "--num-experts") + ["--num-experts", local]


def limit_run(extra: list[str], nproc: int, steps: int, out: Path, seed: int,
              timeout: float) -> list[Path]:
    """``nproc`` single-rank trainings at once: the same per-rank work, no communication."""
    dirs = [out / f"nocomm-{i}" for i in range(nproc)]
    extra = limit_extra(extra)
    if "--threads" not in extra:  # as many threads per process as each rank of the real run
        extra = extra + ["--threads", str(max(1, (os.cpu_count() or 1) // nproc))]
    procs = [subprocess.Popen(_train_argv(extra, "adam", 1, steps, d, None, seed + i),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i, d in enumerate(dirs)]
    for p in procs:
        if p.wait(timeout=timeout) != 0:
            raise RuntimeError("a no-communication run failed")
    return dirs


def _peer_argv(extra: list[str], peer: str, rank: int, nproc: int, steps: int,
               run_dir: Path, seed: int, start: str | None) -> list[str]:
    argv = [sys.executable, "-m", "moebit.cli.ddp_peer", "--peer", peer,
            "--powersgd-rank", str(rank)]
    if start is not None and start.isdigit():
        argv += ["--powersgd-start", start]
    return argv + ["--", "--nproc", str(nproc), "--steps", str(steps), "--optimizer", "adam",
                   "--run-dir", str(run_dir), "--seed", str(seed), "--samples", "0", *extra]


def _jobs(args: argparse.Namespace, extra: list[str], out: Path) -> list[tuple[str, list[str], Path]]:
    """(label, argv, run folder) of every row except the limit, in the order they run."""
    jobs = []
    dtypes = args.a2a_dtypes.split(",") if args.a2a_dtypes else [None]
    shards = parse_shards(args.shards) if args.shards else [(None, [])]
    for opt in args.optimizers.split(","):
        for dt in dtypes:
            for shard, shard_flags in shards:  # --shards: one row per sharding setting
                exact = opt in ("adam", "lamb", *OUTER_ROWS)
                name = opt if exact or args.freeze_step is None else f"{opt}-freeze{args.freeze_step}"
                inner, flags = row_flags(extra, opt, "node" if args.two_nodes else "world")
                if dt is not None:
                    flags = [*flags, "--a2a-dtype", dt, "--a2a-grad-dtype", dt]
                label = opt if dt is None else f"{opt} a2a={dt}"
                run_dir = out / (name if dt is None else f"{name}-a2a-{dt}")
                if shard is not None:
                    flags, label = [*flags, *shard_flags], f"{label} shard={shard}"
                    run_dir = run_dir.with_name(f"{run_dir.name}-{shard.replace(':', '-')}")
                jobs.append((label, _train_argv(flags, inner, args.nproc, args.steps, run_dir,
                                                args.freeze_step, args.seed), run_dir))
    for peer in args.peers.split(",") if args.peers else []:
        if peer == "torchft_diloco":  # torchft's DiLoCo with this run's --outer-* flags
            run_dir = out / "torchft-diloco"
            jobs.append(("torchft diloco", _peer_argv(row_flags(extra, "diloco", "world")[1], peer, 0,
                                                      args.nproc, args.steps, run_dir, args.seed,
                                                      None), run_dir))
            continue
        ranks = args.powersgd_rank.split(",") if peer == "powersgd" else ["0"]
        for r in ranks:
            label = f"ddp powersgd r={r}" if peer == "powersgd" else "ddp fp16 hook"
            run_dir = out / (f"ddp-powersgd-r{r}" if peer == "powersgd" else "ddp-fp16")
            argv = _peer_argv(without_outer(extra), peer, int(r), args.nproc, args.steps,
                              run_dir, args.seed, args.freeze_step)
            jobs.append((label, argv, run_dir))
    return jobs


def peer_error(run_dir: Path) -> str | None:
    """The one-line reason a peer left in its run folder when it could not run (the torchft
    peer: ``moebit.bench.torchft_peer.ERROR_FILE``), or None."""
    f = run_dir / "peer_error.txt"
    return f.read_text().strip().splitlines()[0] if f.is_file() else None


def failed_row(label: str, run_dir: Path, reason: str, nproc: int) -> dict[str, Any]:
    """A row for a peer that could not run: its reason instead of figures."""
    return {"run": str(run_dir), "optimizer": label, "error": reason, "world_size": nproc,
            "n_params": None, "val_loss": None, "bytes_sent": 0, "frozen_at": None,
            "tokens_per_s": 0.0, "step_s": 0.0, "comm_s_per_step": None, "comm_share": None,
            "time_to_target_s": None}


def _limit_row(args: argparse.Namespace, extra: list[str], out: Path,
               measure_from: int) -> dict[str, Any]:
    dirs = limit_run(extra, args.nproc, args.steps, out, args.seed, args.timeout)
    parts = [measure(d, measure_from) for d in dirs]
    return {"run": str(out / "nocomm-*"), "optimizer": "no communication (limit)",
            "world_size": args.nproc, "n_params": parts[0]["n_params"],
            "val_loss": None, "bytes_sent": 0, "frozen_at": None,
            "tokens_per_s": sum(p["tokens_per_s"] for p in parts),
            "step_s": max(p["step_s"] for p in parts), "comm_s_per_step": 0.0,
            "comm_share": 0.0, "a2a_s_per_step": 0.0, "grad_comm_s_per_step": 0.0,
            "compute_s_per_step": max(p["step_s"] for p in parts), "time_to_target_s": None}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="moebit bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default="adam,onebit_adam")
    ap.add_argument("--a2a-dtypes", default=None,
                    help="token all-to-all wire formats, one row each (e.g. fp32,bf16,int8)")
    ap.add_argument("--peers", default=None,
                    help="peers: powersgd,fp16 (torch DDP), torchft_diloco (torchft's DiLoCo)")
    ap.add_argument("--powersgd-rank", default="4", help="PowerSGD rank(s), e.g. 1,4")
    ap.add_argument("--target-loss", type=float, default=None,
                    help="report the wall time until validation loss first reaches this")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--freeze-step", default=None,
                    help="for the 1-bit optimizers (N or auto); PowerSGD starts there too")
    ap.add_argument("--measure-from", type=int, default=None,
                    help="throughput counted after this step (default: 60%% of the run)")
    ap.add_argument("--link", default=None, help="shape loopback to this rate, e.g. 1gbit")
    ap.add_argument("--limit", action="store_true", help="also run the no-communication limit")
    ap.add_argument("--two-nodes", action="store_true",
                    help="half the ranks on each of two emulated nodes, only the link between "
                         "them shaped to --link; measures the bytes that cross it")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", default="bench-out/train")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--json", default=None, help="write the results here (default OUT/results.json)")
    ap.add_argument("--shards", default=None,
                    help="sharding settings, one row each: none,fsdp,fsdp:rs=int8 (MODE[:rs=F][:ag=F])")
    ap.add_argument("--rank-memory-cap", default=None, metavar="SIZE",
                    help="RLIMIT_AS of every process of a row (2GiB): a row that does not fit fails")
    args = ap.parse_args(argv)
    if args.shards:
        parse_shards(args.shards)  # a bad entry fails before any run starts
    cap_bytes(args.rank_memory_cap)
    if args.limit:
        limit_extra(extra)  # a bad EP limit fails before any run starts
    if args.two_nodes and (not args.link or args.nproc % 2 or args.limit):
        ap.error("--two-nodes needs --link and an even --nproc (and no --limit)")
    return args, extra


def main(argv: list[str]) -> int:
    args, extra = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measure_from = args.measure_from if args.measure_from is not None else int(0.6 * args.steps)
    results, failed, cap = [], [], cap_bytes(args.rank_memory_cap)
    for label, job, run_dir in _jobs(args, extra, out):
        print(f"== {label}: {args.nproc} ranks, {args.steps} steps"
              + (f", link {args.link}" if args.link else ""), file=sys.stderr, flush=True)
        try:
            if cap is not None:  # a row that does not fit the cap is a result, not an abort
                error = run_capped(job, cap, args.timeout)
                if error is not None:
                    failed.append({"optimizer": label, "run": str(run_dir), "error": error})
                    continue
            elif args.two_nodes:
                codes = run_on_two_nodes(job, args.nproc, run_dir, args.link, args.timeout)
                if max(codes):
                    raise RuntimeError(f"two-node run failed ({codes}): {' '.join(job)}")
            else:
                _run(job, args.link, args.timeout)
        except RuntimeError:
            reason = peer_error(run_dir)
            if reason is None:
                raise
            print(f"== {label}: {reason}", file=sys.stderr, flush=True)
            results.append(failed_row(label, run_dir, reason, args.nproc))
            continue
        results.append({**measure(run_dir, measure_from, args.target_loss), "optimizer": label})
    if args.limit:
        print(f"== no-communication limit: {args.nproc} independent single-rank runs",
              file=sys.stderr, flush=True)
        results.append(_limit_row(args, extra, out, measure_from))
    base = results[0] if results else {}
    for r in results:
        r["val_loss_vs_first"] = (r["val_loss"] / base["val_loss"]) if r["val_loss"] else None
        r["bytes_fewer_than_first"] = (base["bytes_sent"] / r["bytes_sent"]) if r["bytes_sent"] else None
        speed = base["tokens_per_s"]
        r["tokens_per_s_vs_first"] = r["tokens_per_s"] / speed if speed else None
        t0, t = base.get("time_to_target_s"), r.get("time_to_target_s")
        r["time_to_target_vs_first"] = (t0 / t) if t0 and t else None
    print(format_table(results, args.link, args.target_loss) if results else "no row finished")
    if args.shards or failed:
        print(format_shard_table(results, failed))
    (Path(args.json) if args.json else out / "results.json").write_text(
        json.dumps({"link": args.link, "nproc": args.nproc, "steps": args.steps,
                    "measure_from": measure_from, "extra": extra,
                    "target_loss": args.target_loss, "results": results,
                    "failed": failed, "rank_memory_cap": cap}, indent=2))
    return 0


def _cell(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(results: list[dict[str, Any]], link: str | None,
                 target: float | None = None) -> str:
    head = ["run", "val loss", "vs first", "MB sent/rank", "fewer bytes", "tokens/s",
            "speed vs first", "step s", "compute s", "grad comm s", "a2a s", "comm share"]
    if target is not None:
        head = head[:1] + [f"s to val {target:g}", "sooner vs first"] + head[1:]
    rows = []
    for r in results:
        if r.get("error"):  # a peer that could not run: its reason under the table
            rows.append([str(r["optimizer"]), "failed"] + ["-"] * (len(head) - 2))
            continue
        row = [
            str(r["optimizer"]) + (f" (froze {r['frozen_at']})" if r.get("frozen_at") else ""),
            _cell(r["val_loss"], ".4f"), _cell(r["val_loss_vs_first"], ".4f"),
            f"{r['bytes_sent'] / 1e6:.1f}", _cell(r["bytes_fewer_than_first"], ".2f"),
            f"{r['tokens_per_s']:.0f}", _cell(r["tokens_per_s_vs_first"], ".2f") + "x",
            f"{r['step_s']:.3f}", _cell(r.get("compute_s_per_step"), ".3f"),
            _cell(r.get("grad_comm_s_per_step") if r.get("comm_s_per_step") is not None
                  else None, ".3f"),
            _cell(r.get("a2a_s_per_step"), ".3f"),
            "-" if r.get("comm_share") is None else f"{100 * r['comm_share']:.0f}%",
        ]
        if target is not None:
            row = row[:1] + [_cell(r.get("time_to_target_s"), ".1f"),
                             _cell(r.get("time_to_target_vs_first"), ".2f")] + row[1:]
        rows.append(row)
    if any("inter_node_bytes_per_token" in r for r in results):  # --two-nodes
        at = head.index("fewer bytes") + 1
        head.insert(at, "node-link B/token")
        for row, r in zip(rows, results, strict=True):
            row.insert(at, _cell(r.get("inter_node_bytes_per_token"), ".4g"))
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    line = "  ".join(f"{{:<{n}}}" for n in w)
    title = f"link: {link or 'loopback (unshaped)'}"
    failed = [f"{r['optimizer']}: failed: {r['error']}" for r in results if r.get("error")]
    return "\n".join([title, line.format(*head), line.format(*("-" * n for n in w))]
                      + [line.format(*x) for x in rows] + failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
