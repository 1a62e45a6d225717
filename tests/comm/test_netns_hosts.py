"""Inside a benchmark namespace, loopback names resolve (no c10d hostname warning per rank)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from moebit.bench import netns

can_shape = (
    sys.platform == "linux" and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
)

_LOOKUP = r"""
import socket
for a in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
    print(socket.getnameinfo((a, 1), socket.NI_NAMEREQD)[0])
"""

_STORE = r"""
import datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=20))
c = dist.TCPStore("127.0.0.1", s.port, 1, False, timeout=datetime.timedelta(seconds=20))
c.set("k", "v"); print(s.get("k").decode())
"""


@pytest.mark.skipif(not can_shape, reason="needs root, Linux and iproute2 (ip, tc)")
def test_loopback_names_resolve_and_c10d_stays_quiet():
    res = netns.run_in_shaped_netns([sys.executable, "-c", _LOOKUP], "1gbit", timeout=60,
                                    capture_output=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["localhost"] * 3
    res = netns.run_in_shaped_netns([sys.executable, "-c", _STORE], "1gbit", timeout=60,
                                    capture_output=True)
    assert res.returncode == 0 and res.stdout.strip() == "v", res.stderr
    assert "hostname of the client socket" not in res.stderr
    assert not any(p.name.startswith(f"moebit-{os.getpid()}-") for p in netns.NETNS_ETC.glob("*"))
