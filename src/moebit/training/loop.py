"""The training loop: one rank's work, launched N times by torch.distributed.run.

``moebit train`` resolves and validates the configuration, writes it into the run
folder and starts the ranks with torchrun; each rank runs ``python -m moebit.training.loop
--resolved-config RUN/config.json``. Data parallel: every rank draws its own batches,
gradients are averaged with bucketed allreduces (expert gradients over their
expert-data-parallel group only), or, for the 1-bit optimizers, the optimizer does the
exchange itself (``moebit.training.grads``). Rank 0 writes metrics (JSON lines), plots and the
final checkpoint.

This is the only loop: a kind of training that needs more (Mixture-of-Students' KD term
and stop rule, ``moebit.distill.run``) passes ``Hooks`` (``moebit.training.hooks``). The loop
takes any model implementing ``moebit.models.interface.CausalLM``; ``build_model`` is
the one place a model is made from the config.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from moebit.comm import stats
from moebit.comm.collectives import DistInfo, broadcast_params_, init_from_env
from moebit.inference.generate import generate
from moebit.models.build import build_model
from moebit.models.interface import CausalLM, is_expert_param
from moebit.moe import split_params_for_ep, update_router_biases_
from moebit.optim import build_optimizer
from moebit.runs import dtype_probe, runtime, tracking
from moebit.runs.metrics import MetricsWriter
from moebit.runs.report import plot_runs
from moebit.training import state as ckpt_io
from moebit.training.config import TrainConfig, build
from moebit.training.data import TrainBatches, check_block_size, load_corpus, val_batches
from moebit.training.evaluation import autocast, evaluate
from moebit.training.grads import (
    NonFiniteLoss,
    average_for_step,
    average_gradients,
    clip_gradients,
    nan_stop_reason,
    non_finite,
    report_freeze,
)
from moebit.training.hooks import Hooks, Loop
from moebit.training.meter import Meter, RunTotals
from moebit.training.tokenized import corpus_for_model

# Re-exported: tests and ``moebit eval`` reach them through this module.
__all__ = ["NonFiniteLoss", "average_gradients", "clip_gradients", "evaluate", "run", "train"]

SAMPLE_PROMPTS = ["def ", "import ", "class ", "    return "]


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def param_groups(model: CausalLM, cfg: TrainConfig | None = None) -> list[dict[str, Any]]:
    """One group for data-parallel parameters; with expert parallelism the experts get
    their own group, averaged over the expert-data-parallel group only."""
    if model.ep_groups is not None:
        return split_params_for_ep(model)  # type: ignore[arg-type]
    return [{"params": [p for p in model.parameters() if p.requires_grad]}]  # type: ignore[attr-defined]


def make_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return build_optimizer(
        cfg.optimizer,
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        freeze_step=cfg.resolved_freeze_step(),
        **cfg.extra,
    )


def broadcast_model(model: CausalLM) -> None:
    """Rank 0's initial weights everywhere; each expert from its expert-data-parallel root."""
    ep = model.ep_groups
    if ep is None:
        broadcast_params_(model)  # type: ignore[arg-type]
    else:
        broadcast_params_(model, expert_dp_group=ep.expert_dp_group,  # type: ignore[arg-type]
                          expert_src=ep.expert_dp_ranks[0], is_expert=is_expert_param)


def emit(log: MetricsWriter | None, trackers: list[tracking.Tracker], rec: dict[str, Any]) -> None:
    """Write one metrics record: the only place records go out (rank 0 holds the log and
    the TensorBoard / W&B trackers, which mirror the JSON lines)."""
    if log is not None:
        log.emit(rec)  # one whole line per write: a crash never leaves half a record
    tracking.log_record(trackers, rec)


def open_metrics(run_dir: Path, info: DistInfo, resumed_at: int | None) -> MetricsWriter | None:
    """Rank 0's metrics log, with the records after a resumed checkpoint dropped."""
    if not info.is_main:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    if resumed_at is not None:
        ckpt_io.trim_metrics(run_dir / "metrics.jsonl", resumed_at)
    return MetricsWriter(run_dir / "metrics.jsonl")


def resume_or_broadcast(run_dir: Path, model: CausalLM, opt: torch.optim.Optimizer,
                        batches: TrainBatches, info: DistInfo, cfg: TrainConfig
                        ) -> ckpt_io.Resumed | None:
    """Continue from the newest checkpoint (``--resume``, or torchrun restarted the ranks),
    else start every rank from rank 0's weights. A restart before the first checkpoint
    starts over."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resumed = None
    if cfg.resume or restarted:
        resumed = ckpt_io.restore(run_dir, model, opt, batches, info, cfg)  # type: ignore[arg-type]
    if resumed is None:
        broadcast_model(model)
    return resumed


def saved_totals(resumed: ckpt_io.Resumed | None, tokens_per_step: int) -> RunTotals:
    """The counters of the attempts before this one (none for a fresh run)."""
    if resumed is None:
        return RunTotals()
    if "totals" in resumed.run_state:
        return RunTotals.from_dict(resumed.run_state["totals"])
    # A checkpoint older than the counters: its time and steps are known, its bytes not.
    return RunTotals(train_time=resumed.train_time, steps_trained=resumed.step,
                     tokens=resumed.step * tokens_per_step)


def start_record(cfg: TrainConfig, info: DistInfo, model: CausalLM, corpus: Any) -> dict[str, Any]:
    return {"kind": "start", "n_params": model.num_params(), "world_size": info.world_size,
            "n_expert_params": model.num_expert_params(),
            "optimizer": cfg.optimizer, "unigram_entropy": corpus.unigram_entropy(),
            "corpus": corpus.source, "train_bytes": len(corpus.train),
            "val_bytes": len(corpus.val), "threads": torch.get_num_threads(),
            **dtype_probe.start_fields(cfg.dtype)}


def end_record(cfg: TrainConfig, model: CausalLM, opt: torch.optim.Optimizer, meter: Meter,
               val_loss: float, wall: float, entropy: float) -> dict[str, Any]:
    """The run's summary; its counters cover every attempt of a resumed run."""
    t = meter.totals()
    return {
        "kind": "end", "steps": cfg.steps, "val_loss": val_loss, "n_params": model.num_params(),
        "unigram_entropy": entropy, "wall": wall, "train_time": t.train_time,
        "bytes_sent": t.bytes_sent, "bytes_recv": t.bytes_recv,
        "tokens_per_s": meter.tokens_per_s(), "frozen_at": getattr(opt, "frozen_at", None),
        "nan_skipped": t.nan_skipped, "collectives": t.collectives,
        "bytes_sent_by_kind": t.bytes_sent_by_kind,
        "comm_rounds": getattr(opt, "comm_rounds", None),
    }


def progress(info: DistInfo, label: str, steps: int, first: int) -> tqdm | None:
    if not info.is_main:
        return None
    return tqdm(total=steps, initial=first, desc=label, unit="step", mininterval=1.0,
                file=sys.stderr, dynamic_ncols=True)


def train(cfg: TrainConfig, run_dir: Path, info: DistInfo, hooks: Hooks | None = None
          ) -> dict[str, Any]:
    """Train on this rank from the config (or resume), and return the ``end`` record."""
    hooks = hooks or Hooks()
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data, cfg.encoding, cfg.encoding_errors)
    if cfg.init_from:  # a Hugging Face model trains on its tokenizer's ids
        corpus = corpus_for_model(corpus, cfg.init_from, cfg.model_config().vocab_size)
    block = cfg.model_config().block_size
    check_block_size(corpus, block)
    model = build_model(cfg).to(info.device)  # type: ignore[attr-defined]
    hooks.init_model(model)
    opt = make_optimizer(cfg, param_groups(model))
    batches = TrainBatches(corpus.train, block, cfg.batch_size, cfg.seed, info.rank)
    vbatches = val_batches(corpus.val, block, cfg.batch_size, cfg.eval_batches, cfg.seed)
    comm_origin = stats.snapshot()  # the run's traffic counts from here, broadcast included
    resumed = resume_or_broadcast(run_dir, model, opt, batches, info, cfg)
    state = resumed.run_state if resumed else {}
    hooks.load_state_dict(state.get("hooks", {}))
    first_step = resumed.step if resumed else 0
    tokens_per_step = cfg.batch_size * block * info.world_size
    totals = saved_totals(resumed, tokens_per_step)
    log = open_metrics(run_dir, info, first_step if resumed else None)
    trackers = tracking.open_trackers(cfg, run_dir, info.rank)
    say: Callable[[dict[str, Any]], None] = partial(emit, log, trackers)
    loop = Loop(cfg, info, model, opt, vbatches, say)
    if resumed:
        say({"kind": "resume", "step": first_step, "from": str(resumed.path),
             "world_size": info.world_size, "resharded": resumed.resharded})
    else:
        say({**start_record(cfg, info, model, corpus), **hooks.start(loop)})
    bar = progress(info, hooks.label, cfg.steps, first_step)
    t_start = time.perf_counter() - (resumed.wall if resumed else 0.0)
    meter = Meter(tokens_per_step, totals, model.num_expert_params() > 0, comm_origin)
    val_loss = float("nan")
    postfix: dict[str, str] = {}
    nan_streak = 0
    model.train()
    for step in range(first_step, cfg.steps):
        hooks.before_step(loop, step)
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batches.next()
        x, y = x.to(info.device), y.to(info.device)
        with autocast(cfg.dtype, info.device):
            out = model(x, y)
        loss = out.loss + out.aux_loss
        term = hooks.extra_loss((x, y), out)
        extra: dict[str, float] = {}
        if term is not None:
            loss, extra = loss + term[0], term[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        averaged = average_for_step(opt)
        norm = clip_gradients(model, cfg.grad_clip)  # type: ignore[arg-type]
        loss_value = float(out.loss.detach())
        # Every rank reaches the same verdict: a lone rank that stops or skips would leave
        # the others blocked in the next collective until the process-group timeout.
        if non_finite(loss_value, norm, averaged):
            nan_streak += 1
            meter.nan_skipped += 1
            say({"kind": "nan", "step": step + 1, "loss": loss_value, "grad_norm": norm,
                 "action": cfg.on_nan})
            why = nan_stop_reason(cfg.on_nan, nan_streak, cfg.max_nan_skips)
            if why is not None:
                raise NonFiniteLoss(
                    f"non-finite loss or gradient at step {step + 1} on some rank (this rank: "
                    f"loss={loss_value}, grad norm={norm}); stopping: {why}")
            opt.zero_grad(set_to_none=True)  # nothing of this step reaches the optimizer
        else:
            nan_streak = 0
            was_frozen = getattr(opt, "frozen_at", None) is not None
            opt.step()
            if cfg.moe and cfg.moe.bias_update_speed > 0:
                update_router_biases_(model)  # aux-loss-free balancing: loads summed over the world
            clipped = cfg.grad_clip > 0 and norm > cfg.grad_clip
            meter.step(time.perf_counter() - t0, loss_value, float(out.aux_loss.detach()), norm,
                       clipped, extra, out.ffn_outputs)
            if not was_frozen and getattr(opt, "frozen_at", None) is not None:
                report_freeze(say, opt, step + 1, meter.clipped_steps / meter.steps_trained,
                              info.rank)
        last = step == cfg.steps - 1
        if meter.win.n and ((step + 1) % cfg.log_every == 0 or last):
            rec = meter.train_record(step + 1, lr, time.perf_counter() - t_start, opt)
            say(rec)
            postfix.update(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                           MB_sent=f"{rec['bytes_sent'] / 1e6:.1f}")
            postfix.update({k: f"{rec[k]:.3f}" for k in extra if k in rec})
        if last and hasattr(opt, "synchronize"):
            # 0/1 Adam's replicas drift between syncs: the run ends on one agreed model.
            # Earlier evaluations use each rank's own replica (rank 0's is logged), so that
            # evaluating or saving never changes the trajectory and resumes stay exact.
            opt.synchronize()
        if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            # Before this step's evaluation: the counters saved cover the steps up to the
            # checkpoint, so a resumed run counts what the straight run counts.
            ckpt_io.save(run_dir, step + 1, model, opt, batches, info, cfg,  # type: ignore[arg-type]
                         wall=time.perf_counter() - t_start, train_time=meter.train_time,
                         run_state={"totals": meter.totals().to_dict(),
                                    "hooks": hooks.state_dict()})
        if (step + 1) % cfg.eval_every == 0 or last:
            val_loss = loop.validate()
            say({"kind": "eval", "step": step + 1, "val_loss": val_loss,
                 "wall": time.perf_counter() - t_start, "train_time": meter.train_time,
                 "bytes_sent": meter.totals().bytes_sent,
                 **hooks.evaluated(loop, step + 1, val_loss)})
            postfix["val"] = f"{val_loss:.3f}"
        if bar is not None:
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    if math.isnan(val_loss):  # resumed at the very end
        val_loss = loop.validate()
    summary = end_record(cfg, model, opt, meter, val_loss, time.perf_counter() - t_start,
                         corpus.unigram_entropy())
    summary.update(hooks.end(loop, summary))
    if cfg.samples and not cfg.init_from:  # byte prompts: moebit's GPT only
        texts = generate(model, SAMPLE_PROMPTS[: cfg.samples], max_new_tokens=120, seed=cfg.seed)
        summary["samples"] = [p + t for p, t in zip(SAMPLE_PROMPTS, texts, strict=False)]
    say(summary)
    runtime.work_done()  # a stop signal from here on leaves a finished run (exit 0)
    tracking.close_trackers(trackers)
    if log is not None:
        log.close()
        plot_runs([run_dir], run_dir)
    return summary


def run(cfg: TrainConfig, run_dir: Path,
        make_hooks: Callable[[DistInfo], Hooks] | None = None) -> dict[str, Any]:
    """Join the process group, train (with the hooks ``make_hooks`` builds), leave it."""
    info = init_from_env(cfg.device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    try:
        return train(cfg, run_dir, info, make_hooks(info) if make_hooks else None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def print_summary(summary: dict[str, Any]) -> None:
    """Rank 0 prints one readable line (the whole record is metrics.jsonl's last line) and
    the samples."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(summary))
        for s in summary.get("samples", []):
            print("---\n" + s)


def summary_line(s: dict[str, Any]) -> str:
    parts = [f"{s['steps']} steps", f"val loss {s['val_loss']:.4f} nats/byte "
             f"({s['val_loss'] / math.log(2):.3f} bits/byte)",
             f"{s['n_params'] / 1e6:.2f}M params", f"{s['tokens_per_s']:.0f} tokens/s",
             f"{s['bytes_sent'] / 1e6:.1f} MB sent per rank", f"{s['train_time']:.1f} s training"]
    if s.get("frozen_at"):
        parts.append(f"variance frozen at step {s['frozen_at']}")
    if s.get("nan_skipped"):
        parts.append(f"{s['nan_skipped']} non-finite steps skipped")
    return "moebit: finished: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moebit.training.loop", description=__doc__)
    ap.add_argument("--resolved-config", required=True,
                    help="config.json written by `moebit train` into the run folder")
    args = ap.parse_args(argv)
    path = Path(args.resolved_config)
    cfg = build(json.loads(path.read_text()), source=str(path))
    print_summary(run(cfg, path.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
