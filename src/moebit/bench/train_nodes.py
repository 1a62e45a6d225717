"""``moebit bench train --two-nodes``: each row on two emulated nodes joined by a slow link.

The ranks of a row are split over two network namespaces (``moebit.bench.twonode``):
``--nproc N`` becomes N/2 ranks on each node, started by two launchers
(``moebit train --nnodes 2 --node-rank i``) that meet at a c10d rendezvous on node 0's
address. Traffic between ranks of one node stays inside its namespace (unshaped); traffic
between the nodes crosses the veth pair, shaped to ``--link`` in each direction. That is
the topology DiLoCo's ``--outer-group node`` is for, and the veth's counters measure
exactly what crosses the slow link (frames, so TCP/IP headers included), row by row.

Node 0 writes the row's run folder (its rank 0 is the run's rank 0: metrics, eval,
checkpoints); node 1 writes ``<run folder>-node1``.
"""

from __future__ import annotations

import json
from pathlib import Path

from moebit.bench.twonode import run_two_nodes

RDZV_PORT = 29531  # inside node 0's fresh namespace: never in use by anything else


def node_argv(job: list[str], node: int, addr: str, nproc: int, run_dir: Path) -> list[str]:
    """``job`` (a ``moebit train`` or peer command line for all ``nproc`` ranks) as node
    ``node``'s launcher: half the ranks, the two-node rendezvous, node 1's own folder."""
    if nproc % 2:
        raise ValueError(f"--two-nodes needs an even --nproc (got {nproc})")
    argv = [*job, "--nproc", str(nproc // 2), "--nnodes", "2", "--node-rank", str(node),
            "--rdzv-endpoint", f"{addr}:{RDZV_PORT}", "--rdzv-id", "moebit-bench-train"]
    if node == 1:
        argv += ["--run-dir", f"{run_dir}-node1"]
    return argv


def run_on_two_nodes(job: list[str], nproc: int, run_dir: Path, link: str,
                     timeout: float) -> list[int]:
    """Run ``job`` over two emulated nodes; returns the exit codes and writes the bytes
    each node sent over the slow link to ``<run folder>/link_bytes.json``."""
    sent: list[int] = []
    codes = run_two_nodes(lambda node, addr: node_argv(job, node, addr, nproc, run_dir), link,
                          timeout=timeout, link_bytes=sent)
    if sent and run_dir.is_dir():
        (run_dir / "link_bytes.json").write_text(json.dumps(
            {"link": link, "node0_to_node1": sent[0], "node1_to_node0": sent[1]}))
    return codes


def link_fields(run_dir: Path, tokens: int) -> dict[str, float | None]:
    """Inter-node bytes of a two-node row (both directions) and per token trained."""
    f = run_dir / "link_bytes.json"
    if not f.is_file():
        return {}
    d = json.loads(f.read_text())
    total = d["node0_to_node1"] + d["node1_to_node0"]
    return {"inter_node_bytes": total, "inter_node_bytes_per_token": total / max(1, tokens),
            "inter_node_peak_direction_bytes": max(d["node0_to_node1"], d["node1_to_node0"])}
