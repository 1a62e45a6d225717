"""Validation (b): the model against the papers' published figures (``moebit plan --papers``).

Sources, as found with the search tool (see docs/benchmarks.md for what was and was not
found):

- Tang et al. 2021, "1-bit Adam" (ICML), section 3.1, Table 1: BERT-Large step profile
  (forward, allreduce, backward, optimizer step in ms) on the 40 Gbit/s Ethernet cluster
  (4 V100 per node) and the 100 Gbit/s InfiniBand cluster (8 V100 per node), fp16
  gradients, sequence length 128. Read from a transcription of the table
  (rajatbisht.net paper summary); abstract: "up to 3.3x higher throughput for BERT-Large
  pre-training and up to 2.9x for SQuAD fine-tuning", "up to 5x less communication".
- Lu et al. 2022, "0/1 Adam" (ICLR 2023), abstract: up to 87% less data volume, 54% fewer
  communication rounds and up to 2x throughput against 1-bit Adam (up to 128 GPUs);
  DeepSpeed's 0/1 Adam tutorial: up to 26x less communication volume on BERT-Large.
- Rajbhandari et al. 2022, "DeepSpeed-MoE" (ICML), sections 3-4: 1.3B+MoE-128 reaches the
  quality of the 6.7B dense model at "5x" less training cost, on 128 A100 GPUs.
"""

from __future__ import annotations

from typing import Any

from moebit.plan import collectives as coll
from moebit.plan.cluster import PRESETS as CLUSTERS
from moebit.plan.model import Setup, compare
from moebit.plan.presets import preset

# network, nodes, GPUs, batch per GPU, grad accumulation, forward, allreduce, backward, step (ms)
TABLE1 = [
    ("ethernet", 16, 64, 1, 1, 36.65, 2205.86, 33.63, 74.96),
    ("ethernet", 16, 64, 16, 1, 35.71, 2275.43, 60.81, 75.59),
    ("ethernet", 16, 64, 16, 4, 137.80, 2259.36, 243.72, 74.92),
    ("ethernet", 8, 32, 16, 1, 37.91, 2173.35, 60.71, 75.63),
    ("ethernet", 4, 16, 16, 1, 36.94, 2133.24, 62.82, 76.85),
    ("ethernet", 2, 8, 16, 1, 34.95, 1897.21, 61.23, 75.26),
    ("ethernet", 1, 4, 16, 1, 35.99, 239.76, 59.95, 74.21),
    ("infiniband", 8, 64, 1, 1, 25.36, 316.18, 23.25, 58.49),
    ("infiniband", 8, 64, 16, 1, 32.81, 336.40, 59.99, 57.79),
    ("infiniband", 8, 64, 16, 4, 131.04, 339.52, 237.92, 56.91),
    ("infiniband", 4, 32, 16, 1, 33.45, 297.28, 56.81, 57.98),
    ("infiniband", 2, 16, 16, 1, 32.86, 183.74, 56.49, 58.60),
    ("infiniband", 1, 8, 16, 1, 32.74, 28.18, 59.73, 57.29),
]
FIT_ROWS = {1, 6, 8, 12}  # rows whose allreduce times set the presets' bandwidths


def _cluster(network: str, nodes: int) -> Any:
    return CLUSTERS[f"tang2021-{network}"].with_(nodes=nodes)


def table1() -> list[dict[str, Any]]:
    """Predicted vs published allreduce and step time for each row of Table 1."""
    bert = preset("bert-large")
    out = []
    for i, (net, nodes, gpus, bs, accum, fwd, ar, bwd, step) in enumerate(TABLE1):
        c = _cluster(net, nodes)
        grp = coll.group_of(c, gpus)
        ar_pred = coll.ring_allreduce(c, grp, bert.total_params() * 2)[0]
        s = Setup(micro_batch=bs, grad_accum=accum, seq_len=128, steps=1, grad_bytes=2)
        row = compare(bert, c, s, ["adam"])[0]
        out.append({
            "network": net, "gpus": gpus, "batch_per_gpu": bs, "grad_accum": accum,
            "fitted": i in FIT_ROWS, "allreduce_ms_published": ar,
            "allreduce_ms_predicted": 1e3 * ar_pred,
            "step_ms_published": fwd + ar + bwd + step, "step_ms_predicted": 1e3 * row["step_s"],
        })
    return out


def speedups(freeze_share: float = 0.15, steps: int = 100000,
             inter_lat: float | None = None) -> list[dict[str, Any]]:
    """Predicted gains of 1-bit Adam and 0/1 Adam over Adam at Table 1's 64-GPU setups."""
    bert = preset("bert-large")
    out = []
    for net in ("ethernet", "infiniband"):
        c = _cluster(net, 16 if net == "ethernet" else 8)
        if inter_lat is not None and net == "ethernet":  # the latency we could not fit
            c = c.with_(inter_lat=inter_lat)
        for accum in (1, 4):
            s = Setup(micro_batch=16, grad_accum=accum, seq_len=128, steps=steps,
                      freeze_step=int(freeze_share * steps), grad_bytes=2)
            rows = compare(bert, c, s, ["adam", "onebit_adam", "zero_one_adam"],
                           window=(steps // 2, steps))
            for r in rows[1:]:
                out.append({
                    "network": net, "gpus": c.world, "batch": 16 * accum * c.world,
                    "optimizer": r["optimizer"],
                    "compressed_throughput_x": r["tokens_per_s_vs_first"],
                    "run_speedup_x": r["run_speedup_vs_first"],
                    "fewer_bytes_x": r["bytes_fewer_than_first"],
                })
    return out


def moe_vs_dense(steps: int = 1000) -> dict[str, Any]:
    """1.3B+MoE-128 (ep 128) against dense 6.7B on 128 A100s: tokens/s and their ratio."""
    c = CLUSTERS["a100-hdr"]
    moe, dense = preset("gpt-1.3b-moe128"), preset("gpt-6.7b")
    s_moe = Setup(micro_batch=4, seq_len=2048, steps=steps, ep_size=128, grad_bytes=2)
    s_dense = Setup(micro_batch=4, seq_len=2048, steps=steps, grad_bytes=2)
    m = compare(moe, c, s_moe, ["adam"])[0]
    d = compare(dense, c, s_dense, ["adam"])[0]
    m_h = compare(moe, c, Setup(**{**vars(s_moe), "hierarchical_a2a": True}), ["adam"])[0]
    return {"moe_tokens_per_s": m["tokens_per_s"], "dense_tokens_per_s": d["tokens_per_s"],
            "ratio": m["tokens_per_s"] / d["tokens_per_s"],
            "ratio_hierarchical_a2a": m_h["tokens_per_s"] / d["tokens_per_s"],
            "moe_comm_share": m["comm_share"], "dense_comm_share": d["comm_share"],
            "flops_ratio": dense.train_flops_per_token() / moe.train_flops_per_token()}


def format_papers() -> str:
    lines = ["1-bit Adam, Table 1 (BERT-Large, fp16 gradients, seq 128): predicted vs published",
             "network     GPUs  bs/GPU  accum  allreduce ms pub/pred     step ms pub/pred"]
    for r in table1():
        mark = " (fitted)" if r["fitted"] else ""
        lines.append(
            f"{r['network']:<11} {r['gpus']:>4}  {r['batch_per_gpu']:>6}  {r['grad_accum']:>5}  "
            f"{r['allreduce_ms_published']:>8.0f} / {r['allreduce_ms_predicted']:<8.0f}"
            f"    {r['step_ms_published']:>6.0f} / {r['step_ms_predicted']:<6.0f}{mark}")
    lines += ["", "Predicted gains over Adam (100k steps, freeze at 15%, moebit's algorithms):",
              "network     GPUs  batch  optimizer      compressed-phase tput  whole run  "
              "fewer bytes"]
    for r in speedups():
        lines.append(f"{r['network']:<11} {r['gpus']:>4}  {r['batch']:>5}  {r['optimizer']:<13}  "
                     f"{r['compressed_throughput_x']:>20.2f}x  {r['run_speedup_x']:>8.2f}x  "
                     f"{r['fewer_bytes_x']:>10.1f}x")
    lat = [r for r in speedups(inter_lat=10e-6) if r["network"] == "ethernet"]
    lines.append("  Ethernet with a 10 us node-link latency instead of 50 us, compressed phase: "
                 + ", ".join(f"batch {r['batch']} {r['optimizer']} "
                             f"{r['compressed_throughput_x']:.2f}x" for r in lat))
    m = moe_vs_dense()
    lines += ["", "DeepSpeed-MoE: 1.3B+MoE-128 (ep 128) vs 6.7B dense, 128 A100 (a100-hdr):",
              f"  tokens/s ratio {m['ratio']:.2f}x (hierarchical all-to-all "
              f"{m['ratio_hierarchical_a2a']:.2f}x), FLOPs/token ratio {m['flops_ratio']:.2f}x, "
              f"comm share MoE {100 * m['moe_comm_share']:.0f}% / dense "
              f"{100 * m['dense_comm_share']:.0f}%"]
    return "\n".join(lines)
