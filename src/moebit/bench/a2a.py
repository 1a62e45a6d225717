"""``moebit bench a2a``: the expert-parallel token exchange alone, per wire format.

Inside training, the time a rank spends in a blocking all-to-all is the wire time plus
the time it waits for the slowest peer to arrive; on a loaded host the wait dominates
and hides what fewer bytes buy. Here every timed collective starts right after a barrier,
so what is measured is the exchange itself. One "step" is what a training step of
``--layers`` MoE blocks sends, through the functions training calls: per block, the split
sizes (``dispatch_route``: one tiny collective), then dispatch and combine forward and
their two gradients backward (``exchange_rows``), rows of ``--d-model`` values for each
of the ``--tokens`` x k routed pairs (uniform routing over ``--experts`` experts).

Each exchange's time is split into ``codec`` (this rank's encode and decode) and ``wire``
(inside the collective: the transfer plus waiting for peers' encode), next to the wire
floor, the bytes on the shaped link divided by its rate (all ranks share one shaped
loopback; with ``--two-nodes``, the busier direction of the veth between the nodes).
Times are means over the ranks; formats are interleaved within each repetition; medians
over repetitions are reported.

    moebit bench a2a --link 1gbit --nproc 4 --dtypes fp32,bf16,int8 --tokens 512 --d-model 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moebit.bench.netns import parse_rate, run_in_shaped_netns
from moebit.bench.twonode import run_two_nodes
from moebit.comm import collectives, stats
from moebit.comm.all_to_all import (
    A2A_DTYPES,
    OP_FLAT,
    OP_INTER,
    OP_INTRA,
    Hierarchy,
    Route,
    dispatch_route,
    encode,
    exchange_rows,
)
from moebit.moe.parallel import expert_parallel_groups

ENV = "MOEBIT_BENCH_A2A_ARGS"
PHASES = ("splits", "codec", "wire")  # seconds per step of each, then their sum


def _name(fmt: str, hierarchy: Hierarchy | None) -> str:
    return fmt if hierarchy is None else f"{fmt} hierarchical"


def _wire_seconds() -> float:
    ops = stats.snapshot().ops
    return sum(ops[o].seconds for o in (OP_FLAT, OP_INTRA, OP_INTER) if o in ops)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()`` after a barrier: its result, its seconds, and the seconds inside collectives."""
    before = _wire_seconds()
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    spent = time.perf_counter() - t0
    return out, spent, _wire_seconds() - before


def _step(x: torch.Tensor, counts_E: torch.Tensor, fmt: str, layers: int,
          hierarchy: Hierarchy | None) -> list[float]:
    """[splits, codec, wire] seconds of one step's exchanges, each after a barrier."""
    spent = [0.0, 0.0, 0.0]
    for _ in range(layers):
        (route, _), s, _ = _timed(lambda: dispatch_route(counts_E, None, hierarchy))
        spent[0] += s
        back = route.reversed()
        y = x.new_empty(sum(route.recv), x.shape[1]).normal_()  # expert outputs, gradients
        for r, rows in ((route, x), (back, y), (route, x), (back, y)):
            _, s, w = _timed(lambda r=r, rows=rows: exchange_rows(rows, r, fmt))
            spent[1] += s - w
            spent[2] += w
    return spent


def _link_bytes(route: Route, row: int, layers: int, two_nodes: bool) -> torch.Tensor:
    """This rank's bytes per step on the shaped link: [all off-rank bytes, to node 1 from
    node 0, to node 0 from node 1] (only the first, or only the last two, matter)."""
    me, n = collectives.rank(), len(route.send)
    off = 2 * layers * row * (sum(route.send) - route.send[me] + sum(route.recv) - route.recv[me])
    out = torch.tensor([float(off), 0.0, 0.0], dtype=torch.float64)
    if two_nodes:  # rows to the other node: dispatch and gradients of combine go out on
        # the route, combine and gradients of dispatch on the reverse (as many as arrive)
        half = n // 2
        mine = me // half
        remote = [r for r in range(n) if r // half != mine]
        out[1 + mine] += 2 * layers * row * sum(route.send[r] for r in remote)
        out[2 - mine] += 2 * layers * row * sum(route.recv[r] for r in remote)
    return out


def worker(args: argparse.Namespace) -> None:
    info = collectives.init_from_env("cpu")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1000 + info.rank)
    pairs = args.tokens * args.k
    counts_E = torch.bincount(torch.randint(0, args.experts, (pairs,), generator=g),
                              minlength=args.experts)
    x = torch.randn(pairs, args.d_model, generator=g)
    fmts = args.dtypes.split(",")
    cases = [(f, None) for f in fmts]
    if args.two_nodes:  # flat and hierarchical, interleaved
        hier = expert_parallel_groups(info.world_size, hierarchical=True).hierarchy
        cases += [(f, hier) for f in fmts]
    times = {_name(f, h): [] for f, h in cases}
    for rep in range(args.warmup + args.reps):
        for f, h in cases:
            s = _step(x, counts_E, f, args.layers, h)
            if rep >= args.warmup:
                times[_name(f, h)].append(s)
    route, _ = dispatch_route(counts_E, None)
    link = {f: _link_bytes(route, encode(x[:1], f).numel() * encode(x[:1], f).element_size(),
                           args.layers, args.two_nodes) for f in fmts}
    own = {f: float(t[0]) for f, t in link.items()}  # this rank's off-rank bytes
    for t in link.values():
        dist.all_reduce(t)
    mine = torch.tensor([times[_name(f, h)] for f, h in cases], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(info.world_size)]
    dist.all_gather(every, mine)  # [rank][case][rep][phase]
    if info.rank == 0:
        out = _summary(args, cases, torch.stack(every), link, own)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": out}, indent=2))
    dist.destroy_process_group()


def _summary(args: argparse.Namespace, cases: list[tuple[str, Hierarchy | None]],
             t_RCPX: torch.Tensor, link: dict[str, torch.Tensor],
             own: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Per case: medians over repetitions of the mean over ranks, per phase and in all."""
    rate = parse_rate(args.link) / 8 if args.link else None  # bytes per second
    out: dict[str, dict[str, float | None]] = {}
    for c, (f, h) in enumerate(cases):
        t = t_RCPX[:, c]  # [rank, rep, phase]
        total = t.sum(2)
        on_link = float(link[f][1:].max() if args.two_nodes else link[f][0])
        row = {"s_per_step": statistics.median(total.mean(0).tolist()),
               "s_per_step_slowest_rank": statistics.median(total.max(0).values.tolist())}
        row |= {f"{p}_s_per_step": statistics.median(t[:, :, i].mean(0).tolist())
                for i, p in enumerate(PHASES)}
        row["MB_sent_per_step_rank0"] = own[f] / 1e6
        row["MB_on_link_per_step"] = on_link / 1e6
        row["floor_s_per_step"] = on_link / rate if rate else None
        out[_name(f, h)] = row
    return out


def _node_cmd(per_node: int, addr: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
            str(per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{addr}:29517", "--rdzv-id", "moebit-bench-a2a",
            "--module", "moebit.bench.a2a", "--worker"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moebit bench a2a", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2, help="MoE blocks per step")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--link", default=None, help="shape loopback to this rate, e.g. 1gbit")
    ap.add_argument("--two-nodes", action="store_true",
                    help="two emulated nodes (namespaces joined by a veth shaped to --link), "
                         "flat and hierarchical exchanges side by side")
    ap.add_argument("--json", default="bench-out/a2a.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args = ap.parse_args(json.loads(os.environ[ENV]) + ["--worker"])
    for f in args.dtypes.split(","):
        if f not in A2A_DTYPES:
            raise SystemExit(f"--dtypes: {f!r} is not one of {', '.join(A2A_DTYPES)}")
    if args.worker:
        worker(args)
        return 0
    if args.experts % args.nproc:
        raise SystemExit(f"--experts {args.experts} is not divisible by --nproc {args.nproc}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    # The ranks get the flags through the environment: torchrun's own parser would take
    # "--nproc" after the module name for an abbreviation of its "--nproc-per-node".
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc), "--module", "moebit.bench.a2a", "--worker"]
    env = {ENV: json.dumps(argv)}
    if args.two_nodes:
        if not args.link or args.nproc % 2:
            raise SystemExit("--two-nodes needs --link and an even --nproc")
        codes = run_two_nodes(lambda node, addr: _node_cmd(args.nproc // 2, addr),
                              args.link, env=env, timeout=1800)
        proc = subprocess.CompletedProcess(cmd, max(codes))
    elif args.link:
        proc = run_in_shaped_netns(cmd, args.link, env=env, timeout=1800)
    else:
        proc = subprocess.run(cmd, env={**os.environ, **env}, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"moebit bench a2a: the ranks failed ({proc.returncode})")
    _print_table(args, json.loads(Path(args.json).read_text())["results"])
    return 0


def _print_table(args: argparse.Namespace, res: dict[str, dict[str, Any]]) -> None:
    first = next(iter(res.values()))
    print(f"link: {args.link or 'loopback (unshaped)'}; {args.nproc} ranks, {args.tokens} tokens "
          f"x k={args.k}, d {args.d_model}, E {args.experts}, {args.layers} MoE blocks per step; "
          "seconds per step, mean over ranks, median of reps")
    print(f"{'format':<18} {'MB/step':>8} {'on link':>8} {'floor s':>8} {'a2a s':>8} "
          f"{'splits':>8} {'codec':>8} {'wire':>8} {'vs first':>8} {'x floor':>8}")
    for f, r in res.items():
        floor = r["floor_s_per_step"]
        print(f"{f:<18} {r['MB_sent_per_step_rank0']:>8.2f} {r['MB_on_link_per_step']:>8.2f} "
              f"{floor if floor is not None else float('nan'):>8.4f} {r['s_per_step']:>8.4f} "
              f"{r['splits_s_per_step']:>8.4f} {r['codec_s_per_step']:>8.4f} "
              f"{r['wire_s_per_step']:>8.4f} {first['s_per_step'] / r['s_per_step']:>7.2f}x "
              f"{r['s_per_step'] / floor if floor else float('nan'):>7.2f}x")
    print("MB/step: sent by rank 0; on link: all ranks' bytes on the shaped link (two nodes: "
          "its busier direction); floor: on link / rate; codec: encode + decode on this rank; "
          "wire: inside the collectives (transfer and waiting for peers)")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
