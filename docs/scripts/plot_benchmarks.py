"""Draw the four summary plots of docs/benchmarks.md from docs/scripts/bench_figures.json.

The figures are the headline results of the pages under docs/benchmarks/, copied there as
strings exactly as the pages print them, so that ``--check`` can confirm each one still
appears in the page it cites: a plot can never show a number the docs do not. Nothing is
measured here; re-measuring means running the commands in docs/benchmarks.md and updating
the pages and this JSON together.

    python docs/scripts/plot_benchmarks.py            # check, then write docs/img/bench-*.png
    python docs/scripts/plot_benchmarks.py --check    # check only

Needs only matplotlib, which moebit already depends on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
FIGURES = Path(__file__).with_name("bench_figures.json")
PAGES = DOCS / "benchmarks"
IMG = DOCS / "img"

# One colour per role, the same in every plot: moebit, its baselines, its peers, limits.
MOEBIT, MOEBIT2, MOEBIT3 = "#1f5fa8", "#4f8fd0", "#9cc3ea"
BASE, PEER, PEER2, LIMIT = "#8c8c8c", "#d9822b", "#b5651d", "#3a9b5c"


def leaves(node, path=()):
    """Yield (path, string) for every figure in the JSON tree below ``node``."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves(v, (*path, str(i)))
    elif isinstance(node, dict):
        for k, v in node.items():
            if k not in ("source", "title", "clients", "not_reached"):
                yield from leaves(v, (*path, k))


def check(figs: dict) -> list[str]:
    """Every numeric figure must appear, as a whole number token, in its source page."""
    errors = []
    for area, plots in figs.items():
        if area.startswith("_"):
            continue
        for name, plot in plots.items():
            page = PAGES / plot["source"]
            if not page.is_file():
                errors.append(f"{area}.{name}: source page {page} not found")
                continue
            text = page.read_text()
            for path, value in leaves(plot):
                pattern = rf"(?<![\d.]){re.escape(value)}(?![\d])"
                if not re.search(pattern, text):
                    errors.append(f"{area}.{name}.{'.'.join(path)} = {value}: not in {page.name}")
    return errors


def f(s: str) -> float:
    return float(s)


def bar_labels(ax, bars, texts):
    """Each bar labelled, above its top, with the figure as the page prints it."""
    for b, t in zip(bars, texts, strict=True):
        h = b.get_height()
        ax.annotate(t, (b.get_x() + b.get_width() / 2, h), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)


def inside_labels(ax, bars, texts):
    """White labels just inside the top of each bar, clear of target lines drawn at bar height."""
    for b, t in zip(bars, texts, strict=True):
        ax.annotate(t, (b.get_x() + b.get_width() / 2, b.get_height()), xytext=(0, -3),
                    textcoords="offset points", ha="center", va="top", fontsize=8,
                    color="white", fontweight="bold")


def grouped_bars(ax, groups: dict, colors: list[str], suffix="", width=0.8):
    """Bars for {group: {series: value}}, series side by side within each group."""
    names = list(next(iter(groups.values())))
    n = len(names)
    for i, s in enumerate(names):
        xs = [g + (i - (n - 1) / 2) * width / n for g in range(len(groups))]
        ys = [f(v[s]) for v in groups.values()]
        bars = ax.bar(xs, ys, width / n, label=s, color=colors[i % len(colors)])
        bar_labels(ax, bars, [v[s] + suffix for v in groups.values()])
    ax.set_xticks(range(len(groups)), list(groups))
    ax.grid(axis="y", alpha=0.3)


def plot_communication(plt, d: dict, out: Path):
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    ar = d["allreduce"]
    grouped_bars(a, ar["x_faster_than_fp32"], [BASE, PEER, MOEBIT2, MOEBIT, MOEBIT3], "x")
    a.set_yscale("log")
    a.set_ylim(0.3, 400)
    a.axhline(1, color="black", lw=0.8)
    a.axhline(f(ar["target_1gbit"]), color="red", ls="--", lw=1, label="target at 1 Gbit/s (20x)")
    a.set_ylabel("speed-up over fp32 allreduce (x, log scale)")
    a.set_title(ar["title"], fontsize=10)
    a.legend(fontsize=8, loc="upper right", ncol=2)

    aa = d["a2a"]
    groups = aa["a2a_s_per_step"]
    fmts = list(next(iter(groups.values())))
    colors = [BASE, MOEBIT2, MOEBIT]
    w = 0.8 / len(fmts)
    for i, fm in enumerate(fmts):
        xs = [g + (i - 1) * w for g in range(len(groups))]
        ys = [f(v[fm]) * 1e3 for v in groups.values()]
        bars = b.bar(xs, ys, w, color=colors[i], label=f"{fm} dispatch")
        inside_labels(b, bars, [f"{aa['x_faster_than_fp32'][k][fm]}x" for k in groups])
        floors = [f(aa["floor_s"][k][fm]) * 1e3 for k in groups]
        b.scatter(xs, floors, marker="_", s=400, color="black", zorder=3,
                  label="wire floor (bytes / line rate)" if i == 0 else None)
    b.set_xticks(range(len(groups)), [f"{k} (top-{k[-1]} routing)" for k in groups])
    b.grid(axis="y", alpha=0.3)
    b.set_ylabel("all-to-all time per training step (ms)")
    b.set_title(aa["title"] + " (in bars: x faster than fp32)", fontsize=10)
    b.legend(fontsize=8)
    save(fig, out)


def plot_moe_layer(plt, d: dict, out: Path):
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    ly = d["layer"]
    grouped_bars(a, ly["fwd_bwd_ms_median"], [LIMIT, MOEBIT, MOEBIT3, PEER, BASE])
    a.hlines(f(ly["bf16_target_ms"]), 0.6, 1.4, colors="red", linestyles="--",
             label="bf16 target: 3x faster than fp32 lower bound (not met)")
    a.set_ylim(0, 3400)
    a.set_ylabel("forward+backward time (ms, median of 5)")
    a.set_title(ly["title"] + ", d_model 512, 4096 tokens, 2 threads", fontsize=10)
    a.legend(fontsize=7.5, ncol=2, loc="upper right")

    hf = d["hf_train"]
    parts = list(hf["targets"])
    w = 0.35
    for i, part in enumerate(parts):
        xs = [g + (i - 0.5) * w for g in range(len(hf["ratio"]))]
        ys = [f(v[part]) for v in hf["ratio"].values()]
        bars = b.bar(xs, ys, w, color=[MOEBIT, MOEBIT2][i], label=part)
        inside_labels(b, bars, [f"{v[part]}x" for v in hf["ratio"].values()])
        for x in xs:
            b.hlines(f(hf["targets"][part]), x - w / 2, x + w / 2, colors="red", linestyles="--")
    b.plot([], [], color="red", ls="--", label="target")
    b.axhline(1, color="black", lw=0.8)
    b.set_xticks(range(len(hf["ratio"])), list(hf["ratio"]))
    b.set_ylim(0, 1.7)
    b.grid(axis="y", alpha=0.3)
    b.set_ylabel("transformers time / moebit time (x, > 1: moebit faster)")
    b.set_title(hf["title"] + ", fp32, 8 x 512 tokens", fontsize=10)
    b.legend(fontsize=8, loc="upper left")
    save(fig, out)


def hbars(ax, values: dict, colors: list[str], fmt, missing=()):
    names = [*values, *missing]
    ys = [f(values[n]) if n in values else 0 for n in names]
    bars = ax.barh(range(len(names)), ys, color=colors[: len(names)])
    for i, (bar, n) in enumerate(zip(bars, names, strict=True)):
        label = fmt(bar.get_width()) if n in values else "not reached in 100 steps"
        ax.annotate(label, (bar.get_width(), i), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.margins(x=0.25)


def plot_training(plt, d: dict, out: Path):
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.6))
    tp = d["throughput"]
    adam = f(tp["tokens_per_s"]["Adam"])
    hbars(a, tp["tokens_per_s"], [BASE, MOEBIT, LIMIT], lambda v: f"{v:.0f} ({v / adam:.2f}x)")
    a.set_xlabel("tokens/s (all ranks; x Adam)")
    a.set_title(tp["title"], fontsize=10)

    tl = d["time_to_loss"]
    hbars(b, tl["seconds"], [BASE, PEER2, PEER, MOEBIT2, MOEBIT], lambda v: f"{v:.1f} s",
          missing=tl["not_reached"])
    b.set_xlabel("wall seconds until validation loss <= 2.3 (lower is better)")
    b.set_title(tl["title"], fontsize=10)

    ep = d["ep_training"]
    base = f(ep["tokens_per_s"]["fp32 dispatch"])
    hbars(c, ep["tokens_per_s"], [BASE, MOEBIT2, MOEBIT, LIMIT],
          lambda v: f"{v:.0f} ({v / base:.2f}x)")
    c.set_xlabel("tokens/s (all ranks; x fp32 dispatch)")
    c.set_title(ep["title"], fontsize=10)
    save(fig, out)


def plot_inference(plt, d: dict, out: Path):
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.8))
    de = d["decode"]
    grouped_bars(a, de["ms_per_step"], [BASE, MOEBIT2, MOEBIT3, MOEBIT])
    a.set_yscale("log")
    a.set_ylim(1, 1000)
    a.set_ylabel("ms per decode step (log scale, lower is better)")
    a.set_title(de["title"], fontsize=10)
    a.legend(fontsize=8)

    hd = d["hf_decode"]
    grouped_bars(b, hd["ms_per_step"], [PEER, MOEBIT2, MOEBIT])
    b.set_xticks(range(len(hd["ms_per_step"])), [k.replace(", ", "\n") for k in hd["ms_per_step"]])
    b.set_ylabel("ms per decode step (lower is better)")
    b.set_title(hd["title"], fontsize=10)
    b.legend(fontsize=8)

    sv = d["serving"]
    xs = [int(x) for x in sv["clients"]]
    styles = [(MOEBIT, "-", "o"), (BASE, "-", "s"), (PEER, "-", "^"), (MOEBIT, ":", "o"), (BASE, ":", "s")]
    for (name, ys), (col, ls, mk) in zip(sv["tokens_per_s"].items(), styles, strict=True):
        c.plot(xs, [f(y) for y in ys], color=col, ls=ls, marker=mk, label=name)
    c.set_xscale("log", base=2)
    c.set_xticks(xs, [str(x) for x in xs])
    c.grid(alpha=0.3)
    c.set_xlabel("concurrent clients")
    c.set_ylabel("output tokens/s (higher is better)")
    c.set_title(sv["title"], fontsize=10)
    c.legend(fontsize=7)
    save(fig, out)


def save(fig, out: Path):
    fig.tight_layout()
    # No timestamp in the PNG, so an unchanged JSON redraws identical files.
    fig.savefig(out, dpi=110, metadata={"Software": None})
    print(f"wrote {out.relative_to(DOCS.parent)}")


PLOTS = {
    "communication": plot_communication,
    "moe_layer": plot_moe_layer,
    "training": plot_training,
    "inference": plot_inference,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="only check the figures against the pages")
    args = p.parse_args(argv)
    figs = json.loads(FIGURES.read_text())
    errors = check(figs)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    print(f"{sum(1 for k, v in figs.items() if not k.startswith('_') for _ in leaves(v))} figures "
          "found in their pages")
    if args.check:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for area, draw in PLOTS.items():
        draw(plt, figs[area], IMG / f"bench-{area.replace('_', '-')}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
