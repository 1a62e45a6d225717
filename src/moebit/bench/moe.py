"""``moebit bench moe``: one MoE layer, forward and forward+backward, against its peers.

    python -m moebit.bench.moe                                  # the full matrix
    python -m moebit.bench.moe --experts 64 --k 2 --dtypes float32 --json moe.json

Implementations, all on the same input, d_model 512, d_ffn 2048, 4096 tokens by default:

- ``lower_bound``: the compute floor: the float32 router (linear, softmax, top-k) plus each
  expert's MLP on exactly the tokens our layer keeps for it, pre-gathered into separate
  tensors, with separate per-expert weights. No dispatch, no combine.
- ``moebit``: ``moebit.moe.MoE`` (sort-based dispatch, batched experts; its default
  ``kernel="auto"`` runs near-equal expert blocks as padded batched matmuls).
- ``moebit_loop`` / ``moebit_padded`` / ``moebit_grouped``: the same layer with each expert
  kernel forced, to check what ``kernel="auto"`` picks against the best of them. Auto
  measures its candidates afresh in each worker (``bench.tuning.fresh_tuning``); the
  report prints each choice with every candidate's time (``auto`` in the JSON).
- ``onehot_baseline``: THE BASELINE, not our code path: the GShard one-hot dispatch, a
  [S, E, C] dispatch and combine tensor and two einsums (DeepSpeed's method until 2025),
  with the same router and expert weights.
- ``deepspeed``: ``deepspeed.moe.layer.MoE`` if importable (optional extra), one gloo rank.
- ``fairscale``: ``fairscale.nn.MOELayer`` + ``Top2Gate`` if importable (top-2 only; its
  capacity is fixed at 2S/E and its second expert is sampled with Gumbel noise).
- SwiGLU experts, their floor and Hugging Face's ``MixtralSparseMoeBlock`` (eager and
  grouped_mm): dropless, at ``--d-ffn-gated``; see ``moebit.bench.moe_gated``. After each
  (E, k, dtype) a ``ratios`` line gives our SwiGLU layer over its floor, HF grouped_mm over
  our layer, and each auto kernel over the best forced kernel.

Capacity settings are equal: capacity_factor (default 1.0) for train and eval,
min_capacity 4, overflow dropped, position priority (DeepSpeed: use_rts=False,
top2_2nd_expert_sampling=False). ``bfloat16`` means the whole layer's weights and the
input are bf16 (the routers still compute in float32).

Each (E, k, dtype) runs in a fresh subprocess with ``--threads`` threads (default 2) that
builds every implementation and times them interleaved (rep 1 of each, rep 2 of each...),
so that foreign load on a shared machine hits all alike: medians (and minima) over
``--reps`` after ``--warmup``. Peak memory is the growth of the resident set during one
forward+backward (Linux VmHWM, reset through /proc/self/clear_refs after releasing freed
memory with malloc_trim). Gradients already
are set to None before each step (as optimizer.zero_grad does), so the peak includes the
weight gradients, activations and workspace.

``--device cuda`` runs the same layers on the GPU: every timed call ends with
``torch.cuda.synchronize()``, and peak memory is the growth of
``torch.cuda.max_memory_allocated`` during one forward+backward. Threads then only
matter for the host side. The peers (deepspeed, fairscale) stay CPU-only here.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moebit.bench.moe_gated import FLOOR_OF, GATED_BUILDERS, GATED_IMPLS, routed_blocks, summarize
from moebit.bench.tuning import auto_choices, auto_lines, fresh_tuning
from moebit.moe import MoE, MoEConfig
from moebit.testing import free_port

IMPLS = ("lower_bound", "moebit", "moebit_loop", "moebit_padded", "moebit_grouped",
         "onehot_baseline", "deepspeed", "fairscale", *GATED_IMPLS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Step = Callable[[], list[torch.Tensor]]  # runs a forward, returns the outputs to backprop


def _moe_config(spec: dict[str, Any]):  # -> MoEConfig (imported lazily)

    return MoEConfig(
        num_experts=spec["experts"], num_experts_per_tok=spec["k"],
        capacity_factor=spec["cf"], eval_capacity_factor=spec["cf"], min_capacity=4,
        drop_tokens=True, drop_policy="position", d_ffn=spec["d_ffn"],
    )


def _ours(spec: dict[str, Any], x: torch.Tensor) -> tuple[Step, nn.Module]:

    torch.manual_seed(0)
    moe = MoE(spec["d_model"], _moe_config(spec)).to(device=x.device, dtype=x.dtype)
    return (lambda: [moe(x).hidden]), moe


def _ours_kernel(kernel: str) -> Callable[..., tuple[Step, nn.Module]]:
    def build(spec: dict[str, Any], x: torch.Tensor) -> tuple[Step, nn.Module]:
        step, moe = _ours(spec, x)
        moe.experts.kernel = kernel
        return step, moe
    return build


def _lower_bound(spec: dict[str, Any], x: torch.Tensor) -> tuple[Step, nn.Module]:
    """Router + per-expert MLPs on pre-gathered blocks of exactly the kept tokens."""

    torch.manual_seed(0)
    _, moe = _ours(spec, x)
    plan, holder, blocks = routed_blocks(moe, x, spec["experts"])
    ex = moe.experts
    holder.w = nn.ParameterList()
    for e in range(spec["experts"]):
        for t in (ex.w1[e], ex.b1[e], ex.w2[e], ex.b2[e]):
            holder.w.append(nn.Parameter(t.detach().clone()))
    k = spec["k"]

    def step() -> list[torch.Tensor]:
        logits = F.linear(x.float(), holder.router.weight.float())
        weights = torch.topk(torch.softmax(logits, -1), k, dim=-1).values
        outs = [weights]
        for e, xb in enumerate(blocks):
            if xb.shape[0]:
                w1, b1, w2, b2 = holder.w[4 * e : 4 * e + 4]
                outs.append(torch.addmm(b2, F.gelu(torch.addmm(b1, xb, w1)), w2))
        return outs

    return step, holder


def _onehot_baseline(spec: dict[str, Any], x: torch.Tensor) -> tuple[Step, nn.Module]:
    """BASELINE: GShard one-hot [S, E, C] dispatch/combine einsums, same router and experts."""
    torch.manual_seed(0)
    _, moe = _ours(spec, x)
    e_num, k = spec["experts"], spec["k"]

    def step() -> list[torch.Tensor]:
        r = moe.gate(x)
        s = x.shape[0]
        cap = int(r.stats.capacity)
        # slot of each (token, choice) in its expert, choices in priority order (first first)
        mask_PE = F.one_hot(r.expert_SK.t().reshape(-1), e_num) * r.kept_SK.t().reshape(-1, 1)
        slot_P = ((mask_PE.cumsum(0) - 1) * mask_PE).sum(1)
        onehot_slot_PC = F.one_hot(slot_P, cap).to(x.dtype)
        disp_PEC = mask_PE.to(x.dtype).unsqueeze(2) * onehot_slot_PC.unsqueeze(1)
        disp_SEC = disp_PEC.view(k, s, e_num, cap).sum(0)
        w_P = r.weight_SK.t().reshape(-1, 1, 1).to(x.dtype)
        comb_SEC = (disp_PEC * w_P).view(k, s, e_num, cap).sum(0)
        x_ECD = torch.einsum("sec,sd->ecd", disp_SEC, x)
        ex = moe.experts
        h_ECF = F.gelu(torch.baddbmm(ex.b1.unsqueeze(1), x_ECD, ex.w1))
        y_ECD = torch.baddbmm(ex.b2.unsqueeze(1), h_ECF, ex.w2)
        return [torch.einsum("sec,ecd->sd", comb_SEC, y_ECD)]

    return step, moe


def _init_single_rank_gloo() -> None:


    if not dist.is_initialized():
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        dist.init_process_group("gloo", rank=0, world_size=1)


def _mlp(d: int, f: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d))


def _deepspeed(spec: dict[str, Any], x: torch.Tensor) -> tuple[Step, nn.Module]:
    import deepspeed
    from deepspeed.moe.layer import MoE as DSMoE

    _init_single_rank_gloo()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    ds = DSMoE(
        hidden_size=spec["d_model"], expert=_mlp(spec["d_model"], spec["d_ffn"]),
        num_experts=spec["experts"], ep_size=1, k=spec["k"], capacity_factor=spec["cf"],
        eval_capacity_factor=spec["cf"], min_capacity=4, use_residual=False,
        noisy_gate_policy=None, drop_tokens=True, use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    ds.set_deepspeed_parallelism()
    ds = ds.to(x.dtype)
    return (lambda: [ds(x)[0]]), ds


def _fairscale(spec: dict[str, Any], x: torch.Tensor) -> tuple[Step, nn.Module]:
    if spec["k"] != 2:
        raise NotImplementedError("fairscale's MOELayer has only a top-2 gate")
    from fairscale.nn import MOELayer, Top2Gate

    _init_single_rank_gloo()
    torch.manual_seed(0)
    d, f, e = spec["d_model"], spec["d_ffn"], spec["experts"]
    layer = MOELayer(Top2Gate(d, e), nn.ModuleList([_mlp(d, f) for _ in range(e)]))
    layer = layer.to(x.dtype)
    x3 = x.view(x.shape[0], 1, x.shape[1])  # fairscale wants [s, t, m] with s % E == 0
    return (lambda: [layer(x3)]), layer


BUILDERS = {"lower_bound": _lower_bound, "moebit": _ours, "moebit_loop": _ours_kernel("loop"),
            "moebit_padded": _ours_kernel("padded"), "moebit_grouped": _ours_kernel("grouped"),
            "onehot_baseline": _onehot_baseline,
            "deepspeed": _deepspeed, "fairscale": _fairscale, **GATED_BUILDERS}


def _rss_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def _release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _fwd_bwd(step: Step, grads: dict[tuple[int, ...], torch.Tensor]) -> None:
    outs = step()
    gs = []
    for o in outs:
        key = (*o.shape, int(o.dtype == torch.bfloat16))
        if key not in grads:
            g = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
            grads[key] = g.to(device=o.device, dtype=o.dtype)
        gs.append(grads[key])
    torch.autograd.backward(outs, gs)


def _synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` and, on CUDA, a wait for its kernels: the time is the GPU's, not the launch's."""
    if device.type != "cuda":
        return fn

    def run() -> None:
        fn()
        torch.cuda.synchronize(device)

    return run


def _peak_growth_mb(step: Step, grads: dict, zero: Callable[[], None],
                    device: torch.device | None = None) -> float | None:
    """Resident-set growth during one forward+backward (None where VmHWM cannot be reset);
    on CUDA, the growth of the allocator's peak."""
    if device is not None and device.type == "cuda":
        zero()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _fwd_bwd(step, grads)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        zero()
        return (peak - base) / 2**20
    zero()
    _release_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    base = _rss_kib("VmRSS:")
    _fwd_bwd(step, grads)
    peak = _rss_kib("VmHWM:")
    zero()
    return (peak - base) / 1024


def run_config(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Build every implementation for one (E, k, dtype) and time them interleaved.

    Interleaving (rep 1 of each, then rep 2 of each...) makes the ratios fair on a shared
    machine: a burst of foreign load hits every implementation alike.
    """
    torch.set_num_threads(spec["threads"])
    dtype = DTYPES[spec["dtype"]]
    device = torch.device(spec.get("device", "cpu"))
    g = torch.Generator().manual_seed(42)
    x = torch.randn(spec["tokens"], spec["d_model"], generator=g).to(device=device, dtype=dtype)
    x.requires_grad_(True)
    built: dict[str, tuple[Step, nn.Module]] = {}
    out: dict[str, dict[str, Any]] = {}
    for impl in spec["impls"]:
        try:
            built[impl] = BUILDERS[impl](spec, x)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is a result
            out[impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
    grads: dict[tuple[int, ...], torch.Tensor] = {}

    def zero(module: nn.Module) -> Callable[[], None]:
        def fn() -> None:
            for p in [*module.parameters(), x]:
                p.grad = None  # as optimizer.zero_grad() does
        return fn

    def fwd_bwd(step: Step) -> Callable[[], None]:
        return lambda: _fwd_bwd(step, grads)

    times: dict[tuple[str, str], list[float]] = {}
    for phase in ("fwd", "fwd_bwd"):
        for rep in range(spec["warmup"] + spec["reps"]):
            for impl, (step, module) in list(built.items()):
                fn = _synced(step if phase == "fwd" else fwd_bwd(step), device)
                try:
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001
                    out[impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    del built[impl]
                    continue
                zero(module)()
                if rep >= spec["warmup"]:
                    times.setdefault((impl, phase), []).append(dt)
    for impl, (step, module) in built.items():
        fwd, fb = times[(impl, "fwd")], times[(impl, "fwd_bwd")]
        out[impl] = {
            "fwd_ms": 1e3 * statistics.median(fwd), "fwd_bwd_ms": 1e3 * statistics.median(fb),
            "fwd_min_ms": 1e3 * min(fwd), "fwd_bwd_min_ms": 1e3 * min(fb),
            "fwd_all_ms": [round(1e3 * t, 1) for t in fwd],
            "fwd_bwd_all_ms": [round(1e3 * t, 1) for t in fb],
            "peak_mem_mb": _peak_growth_mb(step, grads, zero(module), device),
            "params": sum(p.numel() for p in module.parameters()),
        }
        auto = auto_choices(module)
        if auto:
            out[impl]["auto"] = auto
    return out


def _spawn(spec: dict[str, Any], timeout: float) -> dict[str, dict[str, Any]]:
    cmd = [sys.executable, "-m", "moebit.bench.moe", "--worker", json.dumps(spec)]
    with fresh_tuning(dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))) as env:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {i: {"error": f"timed out after {timeout:.0f}s"} for i in spec["impls"]}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [""]
    return {i: {"error": f"worker exit code {p.returncode}: {tail[0][:300]}"}
            for i in spec["impls"]}


def _parse(argv: list[str]) -> argparse.Namespace:
    def csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
        return lambda s: [kind(v) for v in s.split(",") if v.strip()]

    p = argparse.ArgumentParser(prog="moebit bench moe", description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=csv(int), default=[8, 32, 64])
    p.add_argument("--k", type=csv(int), default=[1, 2])
    p.add_argument("--dtypes", type=csv(str), default=["float32", "bfloat16"])
    p.add_argument("--impls", type=csv(str), default=list(IMPLS))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ffn", type=int, default=2048)
    p.add_argument("--d-ffn-gated", type=int, default=1360,
                   help="expert width of the SwiGLU rows (1360: the FLOPs of GELU at 2048)")
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the layers run (cuda: times end with a synchronize)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds per (E, k, dtype) subprocess")
    p.add_argument("--json", default=None, help="write all results to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in a.impls:
        if name not in IMPLS:
            p.error(f"unknown implementation {name!r}; choose from {', '.join(IMPLS)}")
    for name in a.dtypes:
        if name not in DTYPES:
            p.error(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    if a.device == "cuda" and a.worker is None and not torch.cuda.is_available():
        p.error("--device cuda, but no CUDA device is visible")
    return a


def _fmt(v: float | None, nd: int = 0) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)
    if a.worker is not None:
        print(json.dumps(run_config(json.loads(a.worker))), flush=True)
        return 0

    results: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    where = torch.cuda.get_device_name() if a.device == "cuda" else platform.machine()
    print(f"# moebit bench moe: d_model {a.d_model}, d_ffn {a.d_ffn}, {a.tokens} tokens, "
          f"cf {a.capacity_factor}, {a.threads} threads, {a.device}, median (min) of {a.reps}, "
          f"implementations interleaved; torch {torch.__version__}, {where}")
    print("E   k  dtype     impl                    fwd ms        fwd+bwd ms      peak MB  "
          "fb/LB  fp32 LB/fb")
    fp32_lb: dict[tuple[int, int], float] = {}
    for dtype in sorted(a.dtypes, key=lambda d: d != "float32"):
        for e in a.experts:
            for k in a.k:
                spec = {"impls": a.impls, "experts": e, "k": k, "dtype": dtype,
                        "tokens": a.tokens, "d_model": a.d_model, "d_ffn": a.d_ffn,
                        "d_ffn_gated": a.d_ffn_gated,
                        "cf": a.capacity_factor, "reps": a.reps, "warmup": a.warmup,
                        "threads": a.threads, "device": a.device}
                by_impl = _spawn(spec, a.timeout)
                for floor in {"lower_bound", *FLOOR_OF.values()}:
                    lb = by_impl.get(floor, {}).get("fwd_bwd_ms")
                    if dtype == "float32" and lb:
                        fp32_lb[(e, k, floor)] = lb
                for impl in a.impls:
                    floor = FLOOR_OF.get(impl, "lower_bound")
                    lb = by_impl.get(floor, {}).get("fwd_bwd_ms")
                    r = {**{k2: v for k2, v in spec.items() if k2 != "impls"}, "impl": impl,
                         **by_impl.get(impl, {"error": "no result"})}
                    results.append(r)
                    if "error" in r:
                        print(f"{e:<3d} {k}  {dtype:<9s} {impl:<22s}  skipped: {r['error']}",
                              flush=True)
                        continue
                    fb = r["fwd_bwd_ms"]
                    r["ratio_lower_bound"] = fb / lb if lb else None
                    base = fp32_lb.get((e, k, floor))
                    r["speedup_vs_fp32_lower_bound"] = base / fb if base else None
                    print(f"{e:<3d} {k}  {dtype:<9s} {impl:<22s} "
                          f"{r['fwd_ms']:6.0f} ({r['fwd_min_ms']:5.0f}) "
                          f"{fb:7.0f} ({r['fwd_bwd_min_ms']:6.0f}) "
                          f"{_fmt(r['peak_mem_mb']):>8s}  "
                          f"{_fmt(r['ratio_lower_bound'], 2):>5s}  "
                          f"{_fmt(r['speedup_vs_fp32_lower_bound'], 2):>10s}", flush=True)
                    for line in auto_lines(r.get("auto", {})):
                        print(f"      {line}", flush=True)
                ratios = summarize(by_impl)
                summaries.append({"experts": e, "k": k, "dtype": dtype, **ratios,
                                  "of_minima": summarize(by_impl, "fwd_bwd_min_ms")})
                if ratios:
                    print(f"{e:<3d} {k}  {dtype:<9s} ratios of medians: "
                          + ", ".join(f"{n} {v:.2f}" for n, v in ratios.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "worker"},
                       "torch": torch.__version__, "results": results,
                       "ratios": summaries}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
