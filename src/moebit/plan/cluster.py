"""A cluster as the performance model sees it: devices, two link levels, device rates.

Bandwidths are bytes per second, latencies seconds. ``inter_bw`` is one node's network
link (its NIC), shared by the node's devices; ``intra_bw`` a device's link to the others
in its node. ``shared_link`` describes this machine's benchmark setup instead: every rank
talks through ONE shaped loopback (``moebit bench --link``), so every byte any rank sends
takes its turn on the same token bucket.

Rates given on the command line read like tc's and the papers' ("40gbit", "100mbit",
"25GB/s", "300gbps" is bits); latencies like "5us", "1.5ms".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from moebit.plan.spec import SpecError


@dataclass
class ClusterSpec:
    name: str = "custom"
    nodes: int = 1
    devices_per_node: int = 8
    intra_bw: float = 150e9  # bytes/s per device inside a node
    intra_lat: float = 5e-6
    inter_bw: float = 12.5e9  # bytes/s per node
    inter_lat: float = 10e-6
    flops: float = 100e12  # achieved FLOP/s per device on the training step
    pack_rate: float = 2e10  # elements/s one device 1-bit packs+unpacks (per pass of the buffer)
    update_rate: float = 2e10  # parameters/s one device updates (Adam: memory bound)
    shared_link: bool = False  # all ranks share one link of inter_bw (this machine's netns)
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("nodes", "devices_per_node"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"cluster.{key}: must be a positive integer (got {v!r})")
        for key in ("intra_bw", "inter_bw", "flops", "pack_rate", "update_rate"):
            v = getattr(self, key)
            finite = isinstance(v, (int, float)) and (math.isfinite(v) or key == "update_rate")
            if not finite or v <= 0:  # update_rate inf: the update is priced inside flops
                raise SpecError(f"cluster.{key}: must be positive (got {v!r})")
        for key in ("intra_lat", "inter_lat"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise SpecError(f"cluster.{key}: must be >= 0 (got {v!r})")

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def with_(self, **kw: Any) -> ClusterSpec:
        return replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_BYTES = {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str | float, key: str) -> float:
    """Bytes/s from '40gbit', '100mbit', '25GB/s' or a bare number (bytes/s)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-z/]*)\s*", str(text).lower())
        unit = m.group(2) if m else None
        if m is None or (unit and unit not in _BITS and unit not in _BYTES):
            raise SpecError(f"{key}: cannot read bandwidth {text!r} (e.g. 40gbit, 100mbit, 25GB/s)")
        value = float(m.group(1))
        if unit in _BITS:
            value *= _BITS[unit] / 8
        elif unit in _BYTES:
            value *= _BYTES[unit]
    if not math.isfinite(value) or value <= 0:
        raise SpecError(f"{key}: must be positive (got {text!r})")
    return value


def parse_latency(text: str | float, key: str) -> float:
    """Seconds from '5us', '1.5ms', '0.01s' or a bare number (seconds)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", str(text).lower())
        if m is None or (m.group(2) and m.group(2) not in _TIME):
            raise SpecError(f"{key}: cannot read latency {text!r} (e.g. 5us, 1.5ms)")
        value = float(m.group(1)) * _TIME.get(m.group(2) or "s", 1.0)
    if not math.isfinite(value) or value < 0:
        raise SpecError(f"{key}: must be >= 0 (got {text!r})")
    return value


# Effective bandwidths of the 1-bit Adam paper's clusters come from its own profile (Tang
# et al. 2021, section 3.1, Table 1): BERT-Large fp16 gradients (336M x 2 bytes) take
# 2205.86 ms to allreduce on 16 Ethernet nodes x 4 V100 and 316.18 ms on 8 InfiniBand nodes
# x 8 V100; on one node, 239.76 ms (4 GPUs) and 28.18 ms (8 GPUs). A ring moves
# 2(W-1)/W x 672 MB through each node's link, hence the rates below (NCCL over TCP reaches
# about an eighth of the 40 Gbit/s line rate; over 100 Gbit/s EDR InfiniBand about a third).
# Compute: the same table's forward + backward (~97 ms for 16 x 128 tokens per GPU) and
# optimizer step (~75 ms for 336M parameters).
_V100 = dict(flops=43e12, pack_rate=5e10, update_rate=336e6 / 0.075)
PRESETS: dict[str, ClusterSpec] = {
    "tang2021-ethernet": ClusterSpec(
        "tang2021-ethernet", 16, 4, intra_bw=4.2e9, intra_lat=10e-6, inter_bw=0.60e9,
        inter_lat=50e-6, source="1-bit Adam (Tang et al. 2021) section 3.1 / Table 1: "
        "40 Gbit/s Ethernet, 4 V100 per node; rates fitted to Table 1's allreduce times",
        **_V100),
    "tang2021-infiniband": ClusterSpec(
        "tang2021-infiniband", 8, 8, intra_bw=41.7e9, intra_lat=5e-6, inter_bw=4.2e9,
        inter_lat=5e-6, source="1-bit Adam (Tang et al. 2021) section 3.1 / Table 1: "
        "100 Gbit/s EDR InfiniBand, 8 V100 per node; rates fitted to Table 1",
        **_V100),
    "a100-hdr": ClusterSpec(
        "a100-hdr", 16, 8, intra_bw=240e9, intra_lat=5e-6, inter_bw=8 * 200e9 / 8,
        inter_lat=5e-6, flops=150e12, pack_rate=2e11, update_rate=5e10,
        source="Azure ND A100 v4 as in DeepSpeed-MoE (Rajbhandari et al. 2022) section 5: "
        "8 A100 per node (NVLink), 8 x 200 Gbit/s HDR InfiniBand per node; line rates"),
}


def load_cluster(arg: str | None) -> ClusterSpec:
    """A preset name or a JSON file of ClusterSpec fields (rates may be strings)."""
    if arg is None:
        return ClusterSpec()
    if arg in PRESETS:
        return PRESETS[arg]
    p = Path(arg)
    if not p.is_file():
        raise SpecError(f"cluster: {arg!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"cluster {arg!r}: cannot parse JSON: {e}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"cluster {arg!r}: expected an object of cluster fields")
    return cluster_from_dict(raw, p.stem)


def cluster_from_dict(raw: dict[str, Any], name: str = "custom") -> ClusterSpec:
    known = {f.name for f in fields(ClusterSpec)}
    values: dict[str, Any] = {"name": name}
    for k, v in raw.items():
        if k not in known:
            raise SpecError(f"cluster.{k}: unknown field (known: {', '.join(sorted(known))})")
        if k.endswith("_bw"):
            v = parse_bandwidth(v, f"cluster.{k}")
        elif k.endswith("_lat"):
            v = parse_latency(v, f"cluster.{k}")
        values[k] = v
    return ClusterSpec(**values)
