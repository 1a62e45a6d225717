"""``moebit bench a2a``: the expert-parallel token exchange alone, per wire format.

Inside training, the time a rank spends in a blocking all-to-all is the wire time plus
the time it waits for the slowest peer to arrive; on a loaded host the wait dominates
and hides what fewer bytes buy. Here every timed exchange starts right after a barrier,
so what is measured is the exchange itself (encode, transfer, decode). One "step" is what
a training step of ``--layers`` MoE blocks sends: per block, dispatch and combine forward
and their two gradients backward, rows of ``--d-model`` values for each of the
``--tokens`` x k routed pairs (uniform routing over ``--experts`` experts). Formats are
interleaved within each repetition; medians are reported.

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
from pathlib import Path

import torch
import torch.distributed as dist

from moebit.bench.netns import run_in_shaped_netns
from moebit.bench.twonode import run_two_nodes
from moebit.comm import collectives
from moebit.comm.all_to_all import A2A_DTYPES, Hierarchy, encode, exchange_rows, make_route
from moebit.moe.parallel import expert_parallel_groups

ENV = "MOEBIT_BENCH_A2A_ARGS"


def _name(fmt: str, hierarchy: Hierarchy | None) -> str:
    return fmt if hierarchy is None else f"{fmt} hierarchical"


def _step(x: torch.Tensor, send: list[int], recv: list[int], fmt: str, layers: int,
          hierarchy: Hierarchy | None = None) -> float:
    """Seconds of one step's exchanges, each timed from a common start (after a barrier)."""
    route = make_route(send, recv, None, hierarchy)
    back = route.reversed()
    spent = 0.0
    for _ in range(layers):
        for r in (route, back, route, back):  # dispatch, combine, their gradients
            rows = x if r is route else x.new_empty(sum(recv), x.shape[1]).normal_()
            dist.barrier()
            t0 = time.perf_counter()
            exchange_rows(rows, r, fmt)
            spent += time.perf_counter() - t0
    return spent


def worker(args: argparse.Namespace) -> None:
    info = collectives.init_from_env("cpu")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1000 + info.rank)
    pairs = args.tokens * args.k
    expert = torch.randint(0, args.experts, (pairs,), generator=g)
    counts = torch.bincount(expert, minlength=args.experts)
    send = counts.view(info.world_size, -1).sum(1).tolist()
    every = torch.empty(info.world_size * info.world_size, dtype=torch.int64)
    collectives.all_gather_flat(every, torch.tensor(send), None)
    recv = every.view(info.world_size, -1)[:, info.rank].tolist()
    x = torch.randn(pairs, args.d_model, generator=g)
    fmts = args.dtypes.split(",")
    cases = [(f, None) for f in fmts]
    if args.two_nodes:  # flat and hierarchical, interleaved
        hier = expert_parallel_groups(info.world_size, hierarchical=True).hierarchy
        cases += [(f, hier) for f in fmts]
    times: dict[str, list[float]] = {_name(f, h): [] for f, h in cases}
    for rep in range(args.warmup + args.reps):
        for f, h in cases:
            s = _step(x, send, recv, f, args.layers, h)
            if rep >= args.warmup:
                times[_name(f, h)].append(s)
    if info.rank == 0:
        row_bytes = {f: encode(x[:1], f).numel() * encode(x[:1], f).element_size() for f in fmts}
        off_rank = 2 * args.layers * (sum(send) - send[0] + sum(recv) - recv[0])
        out = {_name(f, h): {"s_per_step": statistics.median(times[_name(f, h)]),
                             "MB_sent_per_step_rank0": off_rank * row_bytes[f] / 1e6}
               for f, h in cases}
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": out}, indent=2))
    dist.destroy_process_group()


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
    res = json.loads(Path(args.json).read_text())["results"]
    first = next(iter(res.values()))
    print(f"link: {args.link or 'loopback (unshaped)'}; {args.nproc} ranks, {args.tokens} tokens "
          f"x k={args.k}, d {args.d_model}, E {args.experts}, {args.layers} MoE blocks per step")
    print(f"{'format':<18} MB sent/step (rank 0)  a2a s/step  vs first")
    for f, r in res.items():
        print(f"{f:<18} {r['MB_sent_per_step_rank0']:<22.2f} {r['s_per_step']:<11.4f} "
              f"{first['s_per_step'] / r['s_per_step']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
