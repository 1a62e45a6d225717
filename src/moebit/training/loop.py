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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from moebit.comm import stats
from moebit.comm.collectives import DistInfo, init_from_env
from moebit.comm.outer_groups import OuterGroups
from moebit.inference.generate import generate_tokens
from moebit.models.hf.tokens import TOKENIZER_FILE
from moebit.models.interface import CausalLM
from moebit.models.registry import family_of
from moebit.moe import update_router_biases_
from moebit.optim import OuterOptimizer
from moebit.runs import runtime, tracking
from moebit.runs.metrics import MetricsWriter
from moebit.runs.report import plot_runs
from moebit.runs.units import loss_text, loss_unit
from moebit.training import state as ckpt_io
from moebit.training.config import TrainConfig, build
from moebit.training.data import TrainBatches, check_block_size, load_corpus, val_batches
from moebit.training.evaluation import autocast
from moebit.training.grads import (
    NonFiniteLoss,
    average_for_step,
    clip_gradients,
    nan_stop_reason,
    non_finite,
    report_freeze,
)
from moebit.training.hooks import Hooks, Loop
from moebit.training.meter import Meter
from moebit.training.setup import (
    build_run_model,
    load_outer,
    lr_at,
    make_optimizer,
    make_outer,
    make_outer_groups,
    open_metrics,
    outer_checkpoint,
    outer_start_fields,
    param_groups,
    resume_or_broadcast,
    saved_totals,
    start_record,
)
from moebit.training.shard_loop import clip_sharded, memory_fields, shard_state
from moebit.training.tokenized import corpus_for_model

SAMPLE_PROMPTS = ["def ", "import ", "class ", "    return "]


def emit(log: MetricsWriter | None, trackers: list[tracking.Tracker], rec: dict[str, Any]) -> None:
    """Write one metrics record: the only place records go out (rank 0 holds the log and
    the TensorBoard / W&B trackers, which mirror the JSON lines)."""
    if log is not None:
        log.emit(rec)  # one whole line per write: a crash never leaves half a record
    tracking.log_record(trackers, rec)


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
        "comm_rounds": getattr(opt, "comm_rounds", None), "outer_syncs": t.outer_syncs,
        "outer_seconds": t.outer_seconds, "shard": cfg.shard, **memory_fields(model, opt),  # type: ignore[arg-type]
    }


def progress(info: DistInfo, label: str, steps: int, first: int) -> tqdm | None:
    if not info.is_main:
        return None
    return tqdm(total=steps, initial=first, desc=label, unit="step", mininterval=1.0,
                file=sys.stderr, dynamic_ncols=True)


def samples(cfg: TrainConfig, model: CausalLM) -> list[str]:
    """A few continuations of code-like prompts, through the model's own tokenizer."""
    tok = family_of(cfg.model_config()).tokenizer(Path(cfg.init_from) if cfg.init_from else None)
    prompts = SAMPLE_PROMPTS[: cfg.samples]
    # every rank decodes every prompt (in lockstep under expert parallelism): a prompt's
    # text does not depend on the rank, and no rank is left without rows
    res = generate_tokens(model, [tok.encode(p) for p in prompts], max_new_tokens=120,
                          seed=cfg.seed, shard=False)
    return [p + tok.decode(ids) for p, ids in zip(prompts, res.tokens, strict=True)]


@dataclass
class Run:
    """One rank's training, as the phases below share it."""

    cfg: TrainConfig
    run_dir: Path
    info: DistInfo
    hooks: Hooks
    model: CausalLM
    opt: torch.optim.Optimizer
    batches: TrainBatches
    loop: Loop
    meter: Meter
    say: Callable[[dict[str, Any]], None]
    log: MetricsWriter | None
    trackers: list[tracking.Tracker]
    entropy: float
    first_step: int
    t_start: float
    bar: tqdm | None = None
    val_loss: float = float("nan")
    nan_streak: int = 0
    postfix: dict[str, str] = field(default_factory=dict)
    unit: dict[str, Any] = field(default_factory=dict)  # the loss's unit (moebit.runs.units)
    # DiLoCo / Streaming DiLoCo (``outer`` != none): the outer optimizer and its groups
    outer: OuterOptimizer | None = None
    groups: OuterGroups | None = None


def start(cfg: TrainConfig, run_dir: Path, info: DistInfo, hooks: Hooks) -> Run:
    """Data, model, optimizer, then the checkpoint to resume (or rank 0's weights), the
    metrics log and the first record."""
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data, cfg.encoding, cfg.encoding_errors)
    # a model from a folder trains on its tokenizer's ids; moebit's GPT on bytes
    text = corpus
    corpus = corpus_for_model(corpus, cfg.init_from, cfg.model_config().vocab_size)
    # the loss is per token of that tokenizer then; bits/byte come from the val text
    unit = loss_unit(len(text.val), len(corpus.val), None if corpus is text else
                     str(Path(str(cfg.init_from)) / TOKENIZER_FILE))
    block = cfg.model_config().block_size
    check_block_size(corpus, block)
    model = build_run_model(cfg, hooks.init_model, info.device)  # sharded under shard
    groups = make_outer_groups(cfg)  # inner averages stay inside the worker
    opt = make_optimizer(cfg, param_groups(model, cfg, groups))
    batches = TrainBatches(corpus.train, block, cfg.batch_size, cfg.seed, info.rank)
    vbatches = val_batches(corpus.val, block, cfg.batch_size, cfg.eval_batches, cfg.seed)
    comm_origin = stats.snapshot()  # the run's traffic counts from here, broadcast included
    resumed = resume_or_broadcast(run_dir, model, opt, batches, info, cfg)
    outer = make_outer(cfg, model, opt, groups)  # theta_sync: the weights every rank now holds
    if outer is not None and groups is not None and resumed is not None:
        load_outer(outer, groups, resumed)
    hooks.load_state_dict((resumed.run_state if resumed else {}).get("hooks", {}))
    first_step = resumed.step if resumed else 0
    tokens_per_step = cfg.batch_size * block * info.world_size
    log = open_metrics(run_dir, info, first_step if resumed else None)
    trackers = tracking.open_trackers(cfg, run_dir, info.rank)
    say: Callable[[dict[str, Any]], None] = partial(emit, log, trackers)
    loop = Loop(cfg, info, model, opt, vbatches, say)
    if resumed:
        say({"kind": "resume", "step": first_step, "from": str(resumed.path),
             "world_size": info.world_size, "resharded": resumed.resharded})
    else:
        say({**start_record(cfg, info, model, corpus), **outer_start_fields(outer, groups),
             **hooks.start(loop)})
    meter = Meter(tokens_per_step, saved_totals(resumed, tokens_per_step),
                  model.num_expert_params() > 0, comm_origin)
    return Run(cfg, run_dir, info, hooks, model, opt, batches, loop, meter, say, log, trackers,
               corpus.unigram_entropy(), first_step,
               time.perf_counter() - (resumed.wall if resumed else 0.0),
               progress(info, hooks.label, cfg.steps, first_step), unit=unit, outer=outer,
               groups=groups)


def step_once(r: Run, step: int) -> None:
    """One optimizer step: forward, backward, gradient exchange, clipping, and either the
    update or (a non-finite loss or gradient on any rank) a skipped step."""
    cfg, info, opt = r.cfg, r.info, r.opt
    r.hooks.before_step(r.loop, step)
    t0 = time.perf_counter()
    lr = lr_at(cfg, step)
    for g in opt.param_groups:
        g["lr"] = lr
    x, y = r.batches.next()
    x, y = x.to(info.device), y.to(info.device)
    with autocast(cfg.dtype, info.device):
        out = r.model(x, y)
    loss = out.loss + out.aux_loss
    term = r.hooks.extra_loss((x, y), out)
    extra: dict[str, float] = {}
    if term is not None:
        loss, extra = loss + term[0], term[1]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if shard_state(r.model) is not None:  # type: ignore[arg-type]
        averaged = True  # FSDP's reduce-scatter averaged them, over the right groups
        norm = clip_sharded(r.model, cfg.grad_clip)  # type: ignore[arg-type]
    else:
        averaged = average_for_step(opt)
        norm = clip_gradients(r.model, cfg.grad_clip)  # type: ignore[arg-type]
    loss_value = float(out.loss.detach())
    # Every rank of a worker reaches the same verdict: a lone rank that stops or skips
    # would leave the others blocked in the next collective until the process-group
    # timeout. With an outer optimizer the gradients were averaged inside the worker
    # only, so the verdict is the worker's (its inner group), never a round trip over the
    # slow link every step: the outer schedule counts loop steps, taken or skipped, so
    # the workers' syncs meet whatever each of them skipped.
    if non_finite(loss_value, norm, averaged, r.groups.inner if r.groups else None):
        skip_step(r, step, loss_value, norm)
        if r.outer is not None:
            outer_step(r, step)
    else:
        r.nan_streak = 0
        was_frozen = getattr(opt, "frozen_at", None) is not None
        opt.step()
        if cfg.moe and cfg.moe.bias_update_speed > 0:
            update_router_biases_(r.model)  # aux-loss-free balancing: loads summed over the world
        if r.outer is not None:
            outer_step(r, step)
        clipped = cfg.grad_clip > 0 and norm > cfg.grad_clip
        r.meter.step(time.perf_counter() - t0, loss_value, float(out.aux_loss.detach()), norm,
                     clipped, extra, out.ffn_outputs)
        if not was_frozen and getattr(opt, "frozen_at", None) is not None:
            report_freeze(r.say, opt, step + 1, r.meter.clipped_steps / r.meter.steps_trained,
                          info.rank)
    log_step(r, step, lr, extra)


def outer_step(r: Run, step: int) -> None:
    """Count the step in the outer schedule; a sync finished here is recorded (an
    ``outer`` record per sync, and the window's means in the next ``train`` record)."""
    assert r.outer is not None
    sync = r.outer.step()
    if sync is not None:
        r.meter.outer_sync(sync)
        r.say({"kind": "outer", "step": step + 1, **sync.as_metrics()})


def skip_step(r: Run, step: int, loss_value: float, norm: float) -> None:
    """A non-finite step: recorded, skipped (nothing reaches the optimizer), or the run
    stops when ``on_nan`` says so or too many came in a row."""
    r.nan_streak += 1
    r.meter.nan_skipped += 1
    r.say({"kind": "nan", "step": step + 1, "loss": loss_value, "grad_norm": norm,
           "action": r.cfg.on_nan})
    why = nan_stop_reason(r.cfg.on_nan, r.nan_streak, r.cfg.max_nan_skips)
    if why is not None:
        raise NonFiniteLoss(
            f"non-finite loss or gradient at step {step + 1} on some rank (this rank: "
            f"loss={loss_value}, grad norm={norm}); stopping: {why}")
    r.opt.zero_grad(set_to_none=True)


def log_step(r: Run, step: int, lr: float, extra: dict[str, float]) -> None:
    last = step == r.cfg.steps - 1
    if r.meter.win.n and ((step + 1) % r.cfg.log_every == 0 or last):
        rec = r.meter.train_record(step + 1, lr, time.perf_counter() - r.t_start, r.opt)
        r.say(rec)
        r.postfix.update(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                         MB_sent=f"{rec['bytes_sent'] / 1e6:.1f}")
        r.postfix.update({k: f"{rec[k]:.3f}" for k in extra if k in rec})


def save_and_evaluate(r: Run, step: int) -> None:
    """The end-of-step duties: the final agreement of replicas, checkpoints, evaluation."""
    cfg = r.cfg
    last = step == cfg.steps - 1
    if last and r.outer is not None:
        # Every worker ends on one agreed model (0/1 Adam's inner replicas agree first).
        r.outer.synchronize()
    elif last and hasattr(r.opt, "synchronize"):
        # 0/1 Adam's replicas drift between syncs: the run ends on one agreed model.
        # Earlier evaluations use each rank's own replica (rank 0's is logged), so that
        # evaluating or saving never changes the trajectory and resumes stay exact.
        r.opt.synchronize()
    if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
        # Before this step's evaluation: the counters saved cover the steps up to the
        # checkpoint, so a resumed run counts what the straight run counts.
        ckpt_io.save(r.run_dir, step + 1, r.model, r.opt, r.batches, r.info, cfg,  # type: ignore[arg-type]
                     wall=time.perf_counter() - r.t_start, train_time=r.meter.train_time,
                     run_state={"totals": r.meter.totals().to_dict(),
                                "hooks": r.hooks.state_dict()},
                     outer_state=outer_checkpoint(r.outer, r.groups))
    if (step + 1) % cfg.eval_every == 0 or last:
        r.val_loss = r.loop.validate()
        r.say({"kind": "eval", "step": step + 1, "val_loss": r.val_loss,
               "wall": time.perf_counter() - r.t_start, "train_time": r.meter.train_time,
               "bytes_sent": r.meter.totals().bytes_sent,
               **r.hooks.evaluated(r.loop, step + 1, r.val_loss)})
        r.postfix["val"] = f"{r.val_loss:.3f}"
    if r.bar is not None:
        r.bar.set_postfix(r.postfix, refresh=False)
        r.bar.update(1)


def finish(r: Run) -> dict[str, Any]:
    """The end record (with samples), the trackers and the plots."""
    if r.bar is not None:
        r.bar.close()
    if r.outer is not None:
        r.outer.close()
    if math.isnan(r.val_loss):  # resumed at the very end
        r.val_loss = r.loop.validate()
    summary = end_record(r.cfg, r.model, r.opt, r.meter, r.val_loss,
                         time.perf_counter() - r.t_start, r.entropy)
    summary.update(r.unit)
    summary.update(r.hooks.end(r.loop, summary))
    if r.cfg.samples:
        summary["samples"] = samples(r.cfg, r.model)
    r.say(summary)
    runtime.work_done()  # a stop signal from here on leaves a finished run (exit 0)
    tracking.close_trackers(r.trackers)
    if r.log is not None:
        r.log.close()
        plot_runs([r.run_dir], r.run_dir)
    return summary


def train(cfg: TrainConfig, run_dir: Path, info: DistInfo, hooks: Hooks | None = None
          ) -> dict[str, Any]:
    """Train on this rank from the config (or resume), and return the ``end`` record."""
    r = start(cfg, run_dir, info, hooks or Hooks())
    r.model.train()  # type: ignore[attr-defined]
    for step in range(r.first_step, cfg.steps):
        step_once(r, step)
        save_and_evaluate(r, step)
    return finish(r)


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
    parts = [f"{s['steps']} steps", f"val loss {loss_text(s['val_loss'], s)}",
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
