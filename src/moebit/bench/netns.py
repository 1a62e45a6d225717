"""Run a command inside a private network namespace whose loopback is a shaped, slow link.

Why: the ranks of a benchmark on one machine talk over loopback at tens of GB/s, which hides
what compression buys on a real network. Inside a fresh namespace, all ranks talk to
127.0.0.1 through a token bucket (``tc ... tbf``) at the given rate, so every flow shares
one commodity link (docs/benchmarks.md, "Shaped link"). Needs root and iproute2 (``ip``, ``tc``) on Linux;
without them this raises ``ShapedLinkUnavailable`` rather than running unshaped. The
namespace is deleted afterwards, whatever happens.

    res = run_in_shaped_netns(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "job.py"],
        rate="1gbit", timeout=600,
    )

Traffic only ever goes to 127.0.0.1 inside the namespace we created.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ShapedLinkUnavailable", "parse_rate", "run_in_shaped_netns"]

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class ShapedLinkUnavailable(RuntimeError):
    """The shaped namespace cannot be made here (not root, not Linux, no ip/tc)."""


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate: '1gbit', '100mbit', '500kbit', '2.5gbit'.

    A bare number means bits per second, and 'bps' means bytes per second, as in tc.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(
            f"cannot read link rate {rate!r}: expected a number and unit like 1gbit, 100mbit"
        )
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if m.group(3) == "bps":
        value *= 8
    if value <= 0:
        raise ValueError(f"link rate must be positive, got {rate!r}")
    return int(value)


def _require_tools() -> tuple[str, str]:
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        raise ShapedLinkUnavailable("a shaped link needs Linux network namespaces")
    if os.geteuid() != 0:
        raise ShapedLinkUnavailable(
            "a shaped link needs root (ip netns, tc); run as root or leave out --link"
        )
    ip, tc = shutil.which("ip"), shutil.which("tc")
    if ip is None or tc is None:
        raise ShapedLinkUnavailable("a shaped link needs iproute2's `ip` and `tc` on PATH")
    return ip, tc


def _run(cmd: Sequence[str]) -> None:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise ShapedLinkUnavailable(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")


NETNS_ETC = Path("/etc/netns")


def _write_hosts(ns: str) -> Path:
    """Give the namespace a hosts file that names its loopback in IPv4, IPv6 and mapped form.

    c10d's store looks up the name of each client socket; on its dual-stack listener a
    client at 127.0.0.1 shows up as ::ffff:127.0.0.1, which the machine's /etc/hosts
    usually lacks, and the namespace has no DNS to ask: every rank then printed "The
    hostname of the client socket cannot be retrieved. err=-3". ``ip netns exec`` mounts
    /etc/netns/NS/hosts over /etc/hosts for the command, so only our namespace sees it.
    """
    folder = NETNS_ETC / ns
    folder.mkdir(parents=True, exist_ok=True)
    names = "localhost " + socket.gethostname()
    (folder / "hosts").write_text(
        "".join(f"{a} {names}\n" for a in ("127.0.0.1", "::1", "::ffff:127.0.0.1")))
    return folder


def run_in_shaped_netns(
    argv: Sequence[str],
    rate: str,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    burst: str = "128kb",
    latency: str = "100ms",
    capture_output: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``argv`` in a fresh namespace whose loopback is limited to ``rate``; delete it after.

    ``env`` is added to the current environment, with ``MASTER_ADDR=127.0.0.1``. On timeout
    the whole process group is killed and ``subprocess.TimeoutExpired`` raised.
    """
    bits = parse_rate(rate)
    ip, tc = _require_tools()
    ns = f"moebit-{os.getpid()}-{secrets.token_hex(3)}"
    _run([ip, "netns", "add", ns])
    etc = None
    try:
        etc = _write_hosts(ns)
        _run([ip, "-n", ns, "link", "set", "lo", "up"])
        _run([ip, "netns", "exec", ns, tc, "qdisc", "add", "dev", "lo", "root", "tbf",
              "rate", f"{bits}bit", "burst", burst, "latency", latency])
        shown = subprocess.run([ip, "netns", "exec", ns, tc, "qdisc", "show", "dev", "lo"],
                               capture_output=True, text=True, timeout=60).stdout
        if "tbf" not in shown:
            raise ShapedLinkUnavailable(f"the tbf qdisc did not take on {ns}: {shown!r}")
        full_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1"}
        proc = subprocess.Popen(
            [ip, "netns", "exec", ns, *argv],
            env=full_env,
            start_new_session=True,
            stdout=subprocess.PIPE if capture_output else None,
            stderr=subprocess.PIPE if capture_output else None,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout or 0, out, err) from None
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        subprocess.run([ip, "netns", "del", ns], capture_output=True, timeout=60)
        if etc is not None:
            shutil.rmtree(etc, ignore_errors=True)
