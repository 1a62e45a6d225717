"""Predictions in ``moebit bench train``'s shape, and their comparison with a measurement.

The same flags (``--optimizers --nproc --steps --freeze-step --measure-from --link --
<moebit train flags>``) give the same JSON fields, so ``moebit plan bench ...`` and
``moebit bench train ...`` compare row by row; ``validate`` re-predicts a measured bench
JSON from its own fields and tabulates predicted against measured.

This machine as a cluster: one node of ``nproc`` ranks; with ``--link`` all of them share
one shaped loopback (the bench's network namespace) of that rate, otherwise they talk
over loopback at the calibrated alpha/beta. The device rate is moebit's own training step
of the same model, timed with ``nproc`` processes at once (the ranks share the cores),
so it includes the optimizer update and every framework overhead the FLOP count misses.
"""

from __future__ import annotations

import math
from typing import Any

from moebit.bench.netns import parse_rate
from moebit.plan import collectives as coll
from moebit.plan.cluster import ClusterSpec
from moebit.plan.loaders import from_train_config
from moebit.plan.model import Setup, compare
from moebit.plan.spec import SpecError
from moebit.training.config import ConfigError, TrainConfig, build, flat_fields, load_file

# Every flat config key (model, MoE and training settings), as `moebit train` takes them.
_FIELDS = {k: f for owner in ("model", "moe", "train") for k, f in flat_fields(owner)}


def parse_train_flags(extra: list[str]) -> TrainConfig:
    """``moebit train`` flags (``--n-layer 2 --moe-residual --config F``) as a TrainConfig."""
    file_values: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--"):
            raise SpecError(f"train flags: expected --name, got {tok!r}")
        name = tok[2:].replace("-", "_")
        key, _, inline = name.partition("=")
        if key == "config" or key in _FIELDS or key.startswith("no_"):
            pass
        elif key in ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "max_restarts"):
            i += 1 if inline else 2  # launch flags: the bench sets them
            continue
        else:
            raise SpecError(f"train flags: unknown setting --{key.replace('_', '-')}")
        if key.startswith("no_") and key[3:] in _FIELDS:
            flags[key[3:]] = False
            i += 1
            continue
        is_bool = _FIELDS[key].type in ("bool", bool, "bool | None") if key in _FIELDS else False
        if is_bool and not inline and (i + 1 >= len(extra) or extra[i + 1].startswith("--")):
            flags[key] = True
            i += 1
            continue
        value = inline or (extra[i + 1] if i + 1 < len(extra) else None)
        if value is None:
            raise SpecError(f"train flags: --{key.replace('_', '-')} needs a value")
        if key == "config":
            file_values = load_file(value)
        else:
            flags[key] = value
        i += 1 if inline else 2
    try:
        return build(file_values, flags, source="--config file")
    except ConfigError as e:
        raise SpecError(f"train flags: {e}") from None


def this_machine(nproc: int, link: str | None, calib: dict[str, Any], flops: float) -> ClusterSpec:
    beta = float(calib["link_beta"])
    alpha = float(calib["link_alpha"])
    if link:
        link_bw = parse_rate(link) / 8.0
        # Loopback's own copy cost still applies under the shaper: bytes queue on the token
        # bucket and are copied by the kernel, one after the other.
        bw = 1.0 / (1.0 / link_bw + 1.0 / beta)
    else:
        bw = beta
    return ClusterSpec(
        name=f"this machine, {nproc} ranks" + (f", shared {link} link" if link else ", loopback"),
        nodes=1, devices_per_node=nproc, intra_bw=beta, intra_lat=alpha, inter_bw=bw,
        inter_lat=alpha, flops=flops, pack_rate=float(calib["pack_rate"]),
        update_rate=math.inf, shared_link=bool(link),
        source="moebit plan --calibrate on this machine",
    )


def bench_predict(optimizers: list[str], nproc: int, steps: int, freeze_step: str | None,
                  measure_from: int, link: str | None, extra: list[str],
                  calib: dict[str, Any]) -> dict[str, Any]:
    cfg = parse_train_flags(extra)
    model = from_train_config(cfg)
    tokens = cfg.batch_size * cfg.model.block_size
    step_s = float(calib["model_step_s"])
    flops = model.train_flops_per_token() * tokens / step_s
    cluster = this_machine(nproc, link, calib, flops)
    freeze = None if freeze_step in (None, "auto") else int(freeze_step)
    setup = Setup(micro_batch=cfg.batch_size, seq_len=cfg.model.block_size, steps=steps,
                  freeze_step=freeze, ep_size=cfg.moe.ep_size if cfg.moe else 1, grad_bytes=4,
                  a2a_bytes=2 if cfg.dtype == "bf16" else 4)
    if not 0 <= measure_from < steps:
        raise SpecError(f"--measure-from: must be in [0, steps) (got {measure_from})")
    rows = compare(model, cluster, setup, optimizers, window=(measure_from + 1, steps))
    evals = steps // cfg.eval_every + (1 if steps % cfg.eval_every else 0)
    eval_bytes = _eval_a2a_bytes(model, cluster, setup, cfg) * evals
    for r in rows:
        r["run"] = "predicted"
        r["val_loss"] = None
        r["bytes_sent"] += eval_bytes
        r["comm_share"] = r["comm_s_per_step"] / r["step_s"]
    base = rows[0]
    for r in rows:
        r["bytes_fewer_than_first"] = base["bytes_sent"] / r["bytes_sent"] if r["bytes_sent"] else None
        r["val_loss_vs_first"] = None
    return {"link": link, "nproc": nproc, "steps": steps, "measure_from": measure_from,
            "extra": extra, "predicted": True, "calibration": calib,
            "cluster": cluster.to_dict(), "model": model.summary(), "results": rows}


def _eval_a2a_bytes(model: Any, cluster: ClusterSpec, setup: Setup, cfg: TrainConfig) -> float:
    """Bytes of one evaluation (eval_batches forward passes: dispatch + combine per block)."""
    if not model.is_moe or setup.ep_size == 1:
        return 0.0
    grp = coll.group_of(cluster, setup.ep_size)
    rows = cfg.batch_size * cfg.model.block_size * model.top_k / setup.ep_size
    per = 0.0
    for layer in model.moe_layers:
        per += 2 * coll.all_to_all(cluster, grp, rows * model.d_model * setup.a2a_bytes)[1]
        per += coll.all_to_all(cluster, grp, model.experts[layer] // setup.ep_size * 8)[1]
    return per * cfg.eval_batches


def compare_rows(measured: dict[str, Any], predicted: dict[str, Any]) -> list[dict[str, Any]]:
    """Row-by-row predicted vs measured (matched by optimizer)."""
    pred = {r["optimizer"]: r for r in predicted["results"]}
    out = []
    for m in measured["results"]:
        p = pred.get(m["optimizer"])
        if p is None:
            continue
        out.append({
            "optimizer": m["optimizer"], "nproc": measured["nproc"], "link": measured["link"],
            "step_s_measured": m["step_s"], "step_s_predicted": p["step_s"],
            "step_err": p["step_s"] / m["step_s"] - 1.0,
            "comm_s_measured": m["comm_s_per_step"], "comm_s_predicted": p["comm_s_per_step"],
            "bytes_measured": m["bytes_sent"], "bytes_predicted": p["bytes_sent"],
            "bytes_err": (p["bytes_sent"] / m["bytes_sent"] - 1.0) if m["bytes_sent"] else None,
        })
    return out


def freeze_of(measured: dict[str, Any]) -> str | None:
    """The freeze step a bench JSON ran with (its compressed rows' ``frozen_at``)."""
    for r in measured["results"]:
        if r.get("frozen_at"):
            return str(r["frozen_at"])
    return None
