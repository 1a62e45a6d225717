"""Two emulated "nodes" on one machine: two network namespaces joined by a shaped veth pair.

Each namespace holds one node's ranks. Ranks of the same node talk over their own
namespace (their own veth address is local, so that traffic never touches the veth and
is not shaped); ranks of different nodes talk over the veth pair, shaped with ``tc tbf``
in both directions to ``rate``. That is the topology the hierarchical all-to-all is
for: fast inside a node, slow between nodes. Needs root and iproute2; only addresses
inside the two namespaces we create are used (10.77.0.1 and 10.77.0.2).

    procs = run_two_nodes(lambda node: [... torchrun --node-rank node ...], "1gbit")
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping

from moebit.bench.netns import NETNS_ETC, _require_tools, _run, parse_rate

ADDRS = ("10.77.0.1", "10.77.0.2")


def _hosts(node: int) -> str:
    """Loopback and both nodes, in IPv4 and IPv4-mapped IPv6 form (c10d looks clients up);
    the machine's hostname is this node's own address, as on a real cluster."""
    lines = [f"{a} localhost" for a in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    for i, addr in enumerate(ADDRS):
        name = f"node{i}" + (f" {socket.gethostname()}" if i == node else "")
        lines += [f"{addr} {name}", f"::ffff:{addr} {name}"]
    return "\n".join(lines) + "\n"


def _veth(tag: str, node: int) -> str:
    return f"mb{node}{tag}"[:15]  # interface names have at most 15 characters


def _setup(ip: str, tc: str, names: list[str], tag: str, bits: int, burst: str,
           latency: str) -> None:
    veth = [_veth(tag, i) for i in range(2)]
    _run([ip, "link", "add", veth[0], "netns", names[0], "type", "veth", "peer", "name",
          veth[1], "netns", names[1]])
    for ns, dev, addr in zip(names, veth, ADDRS, strict=True):
        _run([ip, "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
        _run([ip, "-n", ns, "link", "set", "lo", "up"])
        _run([ip, "-n", ns, "link", "set", dev, "up"])
        _run([ip, "netns", "exec", ns, tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
              f"{bits}bit", "burst", burst, "latency", latency])


def veth_tx_bytes(ip: str, ns: str, dev: str) -> int:
    """Bytes ``dev`` in namespace ``ns`` has sent (frames: payload plus TCP/IP headers)."""
    out = subprocess.run([ip, "-n", ns, "-j", "-s", "link", "show", "dev", dev],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def run_two_nodes(argv_of: Callable[[int, str], list[str]], rate: str,
                  env: Mapping[str, str] | None = None, timeout: float | None = None,
                  burst: str = "128kb", latency: str = "100ms",
                  link_bytes: list[int] | None = None) -> list[int]:
    """Run ``argv_of(node, node0_addr)`` in node's namespace, both at once; return codes.

    Each node's ranks get ``GLOO_SOCKET_IFNAME`` set to its veth, so gloo binds there.
    ``link_bytes``, when given, receives what each node sent over the shaped veth pair
    (node 0 to 1, node 1 to 0), read when both have exited: every byte between the nodes.
    """
    bits = parse_rate(rate)
    ip, tc = _require_tools()
    tag = f"{os.getpid()}{secrets.token_hex(2)}"
    names = [f"moebit-n{i}-{tag}" for i in range(2)]
    made: list[str] = []
    procs: list[subprocess.Popen] = []
    try:
        for i, ns in enumerate(names):
            _run([ip, "netns", "add", ns])
            made.append(ns)
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(_hosts(i))
        _setup(ip, tc, names, tag, bits, burst, latency)
        for i, ns in enumerate(names):
            full = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": _veth(tag, i)}
            procs.append(subprocess.Popen([ip, "netns", "exec", ns, *argv_of(i, ADDRS[0])],
                                          env=full, start_new_session=True))
        codes = [p.wait(timeout=timeout) for p in procs]
        if link_bytes is not None:
            link_bytes[:] = [veth_tx_bytes(ip, ns, _veth(tag, i)) for i, ns in enumerate(names)]
        return codes
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the two-node run did not finish in {timeout} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in made:
            subprocess.run([ip, "netns", "del", ns], capture_output=True, timeout=60)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
