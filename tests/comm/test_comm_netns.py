"""The shaped network namespace: rate parsing, refusal without root, and a real slow link."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from moebit.bench import netns

can_shape = (
    sys.platform == "linux" and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
)

# Sends 4 MB over TCP on 127.0.0.1 and prints the seconds it took and MASTER_ADDR.
_TRANSFER = r"""
import os, socket, threading, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
port = srv.getsockname()[1]
def sink():
    c, _ = srv.accept(); got = 0
    while got < 4_000_000:
        got += len(c.recv(1 << 16))
    c.sendall(b"k")
t = threading.Thread(target=sink); t.start()
s = socket.create_connection(("127.0.0.1", port))
t0 = time.perf_counter(); s.sendall(b"x" * 4_000_000); s.recv(1)
print(time.perf_counter() - t0, os.environ["MASTER_ADDR"])
"""


@pytest.mark.parametrize(
    "text, bits",
    [("1gbit", 10**9), ("100mbit", 10**8), ("2.5gbit", 25 * 10**8), ("500kbit", 5 * 10**5),
     ("10mbps", 8 * 10**7), ("1000", 1000), (" 1Gbit ", 10**9)],
)
def test_parse_rate(text, bits):
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "fast", "1 gigabit", "-1gbit", "0mbit"])
def test_parse_rate_rejects_nonsense(text):
    with pytest.raises(ValueError, match="rate"):
        netns.parse_rate(text)


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netns.ShapedLinkUnavailable, match="root"):
        netns.run_in_shaped_netns(["true"], "1gbit")


def test_refuses_without_tc(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "tc" else "/bin/" + name)
    with pytest.raises(netns.ShapedLinkUnavailable, match="tc"):
        netns.run_in_shaped_netns(["true"], "1gbit")


def _namespaces() -> set[str]:
    """This process's benchmark namespaces (named after its pid: tests running beside this
    one in other processes make their own)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = f"moebit-{os.getpid()}-"
    return {line.split()[0] for line in out.splitlines() if line.startswith(mine)}


@pytest.mark.skipif(not can_shape, reason="needs root with ip and tc on Linux")
def test_the_link_is_really_shaped_and_the_namespace_removed():
    before = _namespaces()
    res = netns.run_in_shaped_netns(
        [sys.executable, "-c", _TRANSFER], "100mbit", timeout=60, capture_output=True
    )
    assert res.returncode == 0, res.stderr
    seconds, addr = res.stdout.split()
    assert addr == "127.0.0.1"
    # 32 Mbit at 100 Mbit/s: at least 0.3 s (unshaped loopback takes a few ms)
    assert float(seconds) > 0.25
    assert _namespaces() - before == set()
    # the namespace goes away after a failing command and after a timeout too
    assert netns.run_in_shaped_netns(["false"], "1gbit").returncode == 1
    with pytest.raises(subprocess.TimeoutExpired):
        netns.run_in_shaped_netns(["sleep", "30"], "1gbit", timeout=0.5)
    assert _namespaces() - before == set()
