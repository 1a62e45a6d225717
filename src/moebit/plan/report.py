"""The plan's outputs: a text table, a JSON document, and speedup plots (matplotlib PNG)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from moebit.plan.cluster import ClusterSpec
from moebit.plan.model import Setup, compare
from moebit.plan.spec import ModelSpec
from moebit.runs.plots import pyplot


def _table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join(f"{{:<{n}}}" for n in w)
    return "\n".join([line.format(*head), line.format(*("-" * n for n in w))]
                     + [line.format(*r) for r in rows])


def count(n: float) -> str:
    """A parameter count at a readable scale: 340M, 1.3B, 120K (never "0M")."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            v = n / scale
            return f"{v:,.3g}{suffix}" if v < 100 else f"{v:,.0f}{suffix}"
    return f"{n:.0f}"


def setup_line(model: ModelSpec, setup: Setup) -> str:
    """What the plan assumed, the defaults filled in: per-device micro-batch, sequence
    length, steps and where 1-bit compression starts."""
    seq = setup.seq_len or model.seq_len
    seq_from = "" if setup.seq_len else " (the model's)"
    freeze_from = "" if setup.freeze_step is not None else " (20% of the steps)"
    return (f"setup: micro-batch {setup.micro_batch} sequences per device x grad-accum "
            f"{setup.grad_accum}, sequence length {seq}{seq_from}, {setup.steps} steps, "
            f"1-bit freeze step {setup.freeze()}{freeze_from}, ep-size {setup.ep_size}")


def format_plan(rows: list[dict[str, Any]], model: ModelSpec, cluster: ClusterSpec,
                setup: Setup | None = None) -> str:
    title = (f"model {model.name}: {count(model.total_params())} parameters "
             f"({count(model.active_params())} active); cluster {cluster.name}: "
             f"{cluster.nodes} x {cluster.devices_per_node} devices, node link "
             f"{cluster.inter_bw * 8 / 1e9:.3g} Gbit/s")
    if setup is not None:
        title += "\n" + setup_line(model, setup)
    head = ["optimizer", "steps exact/1bit/local", "step s (window)", "comm share",
            "tokens/s", "vs first", "run h", "run speedup", "GB sent/rank", "fewer bytes"]
    body = []
    for r in rows:
        k = r["steps_by_kind"]
        body.append([
            r["optimizer"], f"{k['exact']}/{k['onebit']}/{k['local']}", f"{r['step_s']:.4g}",
            f"{100 * r['comm_share']:.0f}%", f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s_vs_first']:.2f}x", f"{r['run_s'] / 3600:.3g}",
            f"{r['run_speedup_vs_first']:.2f}x", f"{r['bytes_sent'] / 1e9:.4g}",
            f"{r['bytes_fewer_than_first']:.1f}x" if r["bytes_fewer_than_first"] else "-",
        ])
    return title + "\n" + _table(head, body)


def format_validation(rows: list[dict[str, Any]]) -> str:
    head = ["ranks", "link", "optimizer", "step s meas", "step s pred", "error",
            "comm s meas", "comm s pred", "MB meas", "MB pred"]
    body = [[str(r["nproc"]), str(r["link"] or "unshaped"), r["optimizer"],
             f"{r['step_s_measured']:.4f}", f"{r['step_s_predicted']:.4f}",
             f"{100 * r['step_err']:+.0f}%", f"{r['comm_s_measured']:.4f}",
             f"{r['comm_s_predicted']:.4f}", f"{r['bytes_measured'] / 1e6:.1f}",
             f"{r['bytes_predicted'] / 1e6:.1f}"] for r in rows]
    return _table(head, body)


def sweep(model: ModelSpec, cluster: ClusterSpec, setup: Setup, optimizers: list[str],
          values: list[float], vary: Callable[[ClusterSpec, float], ClusterSpec]) -> dict[str, list[float]]:
    """Whole-run speedup of each optimizer over the first at each value of one knob."""
    out: dict[str, list[float]] = {o: [] for o in optimizers}
    for v in values:
        for r in compare(model, vary(cluster, v), setup, optimizers):
            out[r["optimizer"]].append(r["run_speedup_vs_first"])
    return out


def plot(model: ModelSpec, cluster: ClusterSpec, setup: Setup, optimizers: list[str],
         out_dir: str) -> list[str]:
    """speedup_vs_bandwidth.png and speedup_vs_nodes.png in ``out_dir``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    gbits = [1, 2, 5, 10, 25, 40, 100, 200, 400, 800, 1600]
    nodes = [1, 2, 4, 8, 16, 32, 64]
    panels = [
        ("speedup_vs_bandwidth.png", "node link (Gbit/s)", gbits,
         lambda c, v: c.with_(inter_bw=v * 1e9 / 8)),
        ("speedup_vs_nodes.png", f"nodes (x {cluster.devices_per_node} devices)", nodes,
         lambda c, v: c.with_(nodes=int(v))),
    ]
    written = []
    for fname, xlabel, xs, vary in panels:
        if fname.endswith("nodes.png"):
            xs = [n for n in xs if (n * cluster.devices_per_node) % setup.ep_size == 0]
        ys = sweep(model, cluster, setup, optimizers, xs, vary)
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        styles = [("o", "-"), ("s", "--"), ("^", "-."), ("x", ":"), ("d", "-")]
        for (o, y), (mk, ls) in zip(ys.items(), styles * 2, strict=False):
            ax.plot(xs, y, marker=mk, linestyle=ls, label=o)  # 1-bit Adam and LAMB coincide
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"whole-run speedup over {optimizers[0]}")
        ax.set_title(f"{model.name} on {cluster.name}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(d / fname, dpi=120)
        plt.close(fig)
        written.append(str(d / fname))
    return written
