"""Compare runs: loss curves on shared axes (PNG) and a table of final figures.

Reads each run folder's ``metrics.jsonl`` (written by rank 0 of ``moebit train``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moebit.runs import metrics
from moebit.runs.plots import pyplot
from moebit.runs.units import bits_per_byte, unit_name


class ReportError(ValueError):
    pass


def read_metrics(run: Path) -> list[dict[str, Any]]:
    path = Path(run) / metrics.FILE_NAME
    if not path.is_file():
        raise ReportError(f"{run}: no metrics.jsonl (is it a moebit run folder?)")
    return metrics.read(path)  # a torn last line is dropped with a warning naming the file


def label_of(run: Path) -> str:
    cfg_path = Path(run) / "config.json"
    name = Path(run).name
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        opt = cfg.get("optimizer", "?")
        moe = f", E={cfg['num_experts']}" if cfg.get("num_experts") else ""
        return f"{name} ({opt}{moe})"
    return name


def unit_of(run: Path, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The loss unit fields of the run's end record; an unfinished run trained
    ``--init-from`` a folder with a tokenizer is per token (bits/byte unknown)."""
    end = next((r for r in reversed(recs) if r.get("kind") == "end"), None)
    if end is not None and "loss_unit" in end:
        return {k: end[k] for k in ("loss_unit", "tokenizer", "tokens_per_byte") if k in end}
    cfg_path = Path(run) / "config.json"
    init = json.loads(cfg_path.read_text()).get("init_from") if cfg_path.is_file() else None
    if init and (Path(init) / "tokenizer.json").is_file():
        return {"loss_unit": "token", "tokenizer": str(Path(init) / "tokenizer.json")}
    return {"loss_unit": "byte"}


def summarize(run: Path) -> dict[str, Any]:
    recs = read_metrics(run)
    start = next((r for r in recs if r.get("kind") == "start"), {})
    end = next((r for r in reversed(recs) if r.get("kind") == "end"), None)
    evals = [r for r in recs if r.get("kind") == "eval"]
    trains = [r for r in recs if r.get("kind") == "train"]
    val = end["val_loss"] if end else (evals[-1]["val_loss"] if evals else math.nan)
    unit = unit_of(run, recs)
    return {
        "unit": unit_name(unit), "bits_per_byte": bits_per_byte(val, unit),
        "tokenizer": unit.get("tokenizer"),
        "run": label_of(run),
        "params": start.get("n_params"),
        "expert_params": start.get("n_expert_params") or 0,
        "steps": end["steps"] if end else (trains[-1]["step"] if trains else 0),
        "val_loss": val,
        "unigram": start.get("unigram_entropy"),
        "tokens_per_s": end["tokens_per_s"] if end else None,
        "MB_sent": (end or (trains[-1] if trains else {})).get("bytes_sent", 0) / 1e6,
        "wall_s": end["wall"] if end else None,
        "frozen_at": end.get("frozen_at") if end else None,
        "finished": end is not None,
        "MB_by_kind": {k: v / 1e6 for k, v in (end or {}).get("bytes_sent_by_kind", {}).items()},
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    cols = ["run", "params", "expert params", "steps", "val_loss", "unit", "bits/byte",
            "vs first", "tokens/s", "MB sent", "bytes vs first", "wall s"]
    lines = []
    for r in rows:
        rel = _relative(r, base)
        vol = (base["MB_sent"] / r["MB_sent"]) if r["MB_sent"] else math.inf
        bpb = r.get("bits_per_byte")
        lines.append([
            r["run"], f"{r['params'] / 1e6:.2f}M" if r["params"] else "?",
            f"{r['expert_params'] / 1e6:.2f}M", str(r["steps"]),
            f"{r['val_loss']:.4f}", r.get("unit", "nats/byte"),
            f"{bpb:.4f}" if bpb is not None else "?", f"{rel:.4f}",
            f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "?",
            f"{r['MB_sent']:.1f}", f"{vol:.2f}x fewer" if r is not base else "-",
            f"{r['wall_s']:.0f}" if r["wall_s"] else "?",
        ])
    widths = [max(len(c), *(len(row[i]) for row in lines)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    kinds = [r for r in rows if r.get("MB_by_kind")]
    if kinds:
        out.append("MB sent per kind (token all-to-all / exact gradient averages / 1-bit):")
        for r in kinds:
            k = r["MB_by_kind"]
            out.append(f"  {r['run']}: a2a {k.get('a2a', 0.0):.1f}, exact "
                       f"{k.get('exact', 0.0):.1f}, 1-bit {k.get('onebit', 0.0):.1f}, other "
                       f"{k.get('other', 0.0):.2f}")
    for tok in sorted({r["tokenizer"] for r in rows if r.get("tokenizer")}):
        out.append(f"(nats/token: per token of {tok})")
    if base.get("unigram"):
        per = "token" if base.get("unit") == "nats/token" else "byte"
        out.append(f"(unigram {per} entropy of the training split: {base['unigram']:.4f} "
                   f"nats/{per})")
    return "\n".join(out)


def _relative(r: dict[str, Any], base: dict[str, Any]) -> float:
    """Loss against the first run's, in bits/byte where the units differ."""
    same = (r.get("unit"), r.get("tokenizer")) == (base.get("unit"), base.get("tokenizer"))
    if same:
        return r["val_loss"] / base["val_loss"] if base["val_loss"] else math.nan
    a, b = r.get("bits_per_byte"), base.get("bits_per_byte")
    return a / b if a is not None and b else math.nan


def _step_offset(recs: list[dict[str, Any]]) -> int:
    """A distilled student continues its teacher's training: its step s is drawn at the
    teacher's last step + s, so teacher and students share one step axis."""
    start = next((r for r in recs if r.get("kind") == "start"), {})
    return int(start.get("teacher_step") or 0)


def plot_runs(runs: list[Path], out_dir: Path) -> list[Path]:
    """Draw loss against step and against wall time, and expert load for MoE runs.

    With distillation runs among them, a third panel zooms on the students' steps, with
    each teacher's final validation loss as a dashed line and the KD stop marked.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_recs = [read_metrics(run) for run in runs]
    offsets = [_step_offset(recs) for recs in all_recs]
    distilled = any(offsets)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3 if distilled else 2, figsize=(18 if distilled else 12, 4.5))
    ax_step, ax_wall = axes[0], axes[1]
    ax_kd = axes[2] if distilled else None
    lo = min((off for off in offsets if off), default=0)
    for run, recs, off in zip(runs, all_recs, offsets, strict=True):
        lab = label_of(run)
        tr = [r for r in recs if r.get("kind") == "train"]
        ev = [r for r in recs if r.get("kind") == "eval"]
        line = ax_step.plot([off + r["step"] for r in tr], [r["loss"] for r in tr], alpha=0.35)[0]
        c = line.get_color()
        ax_step.plot([off + r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", color=c,
                     label=f"{lab} val", ms=3)
        ax_wall.plot([r["wall"] for r in ev], [r["val_loss"] for r in ev], "o-", color=c,
                     label=lab, ms=3)
        frozen = next((r.get("frozen_at") for r in recs if r.get("kind") == "end"), None)
        if frozen:
            ax_step.axvline(off + frozen, color=c, ls=":", lw=1)
        if ax_kd is not None:
            start = next((r for r in recs if r.get("kind") == "start"), {})
            if off:
                ax_kd.plot([off + r["step"] for r in ev], [r["val_loss"] for r in ev], "o-",
                           color=c, label=lab, ms=3)
                stop = next((r for r in recs if r.get("kind") == "kd_stop"), None)
                if stop and stop.get("step"):
                    ax_kd.axvline(off + stop["step"], color=c, ls=":", lw=1)
            elif ev and ev[-1]["step"] >= lo:
                ax_kd.axhline(ev[-1]["val_loss"], color=c, ls="--", lw=1,
                              label=f"{lab}: final val")
            if start.get("teacher_val_loss") is not None and off:
                ax_kd.plot([off], [start["teacher_val_loss"]], "k*", ms=8)
    start = next((r for r in all_recs[0] if r.get("kind") == "start"), {})
    ylabel = " or ".join(sorted({unit_name(unit_of(run, recs))
                                 for run, recs in zip(runs, all_recs, strict=True)}))
    for ax, xl in ((ax_step, "step"), (ax_wall, "wall time (s)")):
        if start.get("unigram_entropy"):
            ax.axhline(start["unigram_entropy"], color="grey", ls="--", lw=1,
                       label="unigram entropy")
        ax.set_xlabel(xl)
        ax.set_ylabel(f"loss ({ylabel})")
        ax.grid(alpha=0.3)
    ax_step.set_title("loss against step (faint: train, dots: validation)")
    ax_wall.set_title("validation loss against wall time")
    ax_step.legend(fontsize=8)
    if ax_kd is not None:
        ax_kd.set_title("students after the teacher (dotted: KD stop, dashed: teacher's final "
                        "val, star: teacher on\nthe students' val batches)", fontsize=9)
        ax_kd.set_xlabel("step (teacher's steps + student's)")
        ax_kd.set_ylabel(f"validation loss ({ylabel})")
        ax_kd.grid(alpha=0.3)
        ax_kd.legend(fontsize=7)
    fig.tight_layout()
    paths = [out_dir / "loss.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    paths += _plot_expert_load(runs, out_dir)
    return paths


def _plot_expert_load(runs: list[Path], out_dir: Path) -> list[Path]:
    """Per MoE block, each expert's share of routed tokens over training."""
    paths = []
    for run in runs:
        tr = [r for r in read_metrics(run) if r.get("kind") == "train" and r.get("expert_load")]
        if not tr:
            continue
        n_layers = len(tr[0]["expert_load"])
        plt = pyplot()
        fig, axes = plt.subplots(1, n_layers, figsize=(4.5 * n_layers, 3.5), squeeze=False)
        steps = [r["step"] for r in tr]
        for li in range(n_layers):
            ax = axes[0][li]
            n_e = len(tr[0]["expert_load"][li])
            for e in range(n_e):
                share = []
                for r in tr:
                    load = r["expert_load"][li]
                    tot = sum(load) or 1.0
                    share.append(load[e] / tot)
                ax.plot(steps, share, lw=0.8)
            ax.axhline(1 / n_e, color="k", ls="--", lw=0.8)
            ax.set_title(f"MoE block {li}: share per expert")
            ax.set_xlabel("step")
        fig.tight_layout()
        p = out_dir / (f"expert_load-{Path(run).name}.png" if len(runs) > 1 else "expert_load.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def report(runs: list[str], out: str | None = None) -> tuple[str, list[Path]]:
    paths = [Path(r) for r in runs]
    for p in paths:
        if not p.is_dir():
            raise ReportError(f"{p}: no such run folder")
    table = format_table([summarize(p) for p in paths])
    out_dir = Path(out) if out else (paths[0].parent if len(paths) > 1 else paths[0])
    try:
        return table, plot_runs(paths, out_dir)
    except OSError as e:
        raise ReportError(f"--out {str(out_dir)!r}: cannot write the plots there: "
                          f"{e.strerror or e}") from None
