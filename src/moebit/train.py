"""The training loop: one rank's work, launched N times by torch.distributed.run.

``moebit train`` resolves and validates the configuration, writes it into the run
folder and starts the ranks with torchrun; each rank runs ``python -m moebit.train
--resolved-config RUN/config.json``. Data parallel: every rank draws its own batches,
gradients are averaged with bucketed allreduces (expert gradients over their
expert-data-parallel group only), or, for the 1-bit optimizers, the optimizer does the
exchange itself. Rank 0 writes metrics (JSON lines), plots and the final checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moebit.checkpoint import train_state as ckpt_io
from moebit.comm import stats
from moebit.comm.collectives import DistInfo, allreduce_mean_, broadcast_params_, init_from_env
from moebit.config import TrainConfig, build
from moebit.data import TrainBatches, check_block_size, load_corpus, val_batches
from moebit.models.gpt import GPT
from moebit.moe import is_expert_param, split_params_for_ep

SAMPLE_PROMPTS = ["def ", "import ", "class ", "    return "]


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def param_groups(model: GPT, cfg: TrainConfig) -> list[dict[str, Any]]:
    """One group for data-parallel parameters; with expert parallelism the experts get
    their own group, averaged over the expert-data-parallel group only."""
    if model.ep_groups is not None:
        return split_params_for_ep(model)
    return [{"params": [p for p in model.parameters() if p.requires_grad]}]


def make_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    from moebit.optim import build_optimizer

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


def average_gradients(opt: torch.optim.Optimizer) -> None:
    """Average each group's gradients over its process group (experts: expert-dp only).

    A missing gradient (an expert that received no token here) counts as zeros, so every
    rank hands the collective buffers of the same size.
    """
    for group in opt.param_groups:
        grads = []
        for p in group["params"]:
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        allreduce_mean_(grads, group=group.get("process_group"), op_name="grad_allreduce")


def average_for_step(opt: torch.optim.Optimizer) -> bool:
    """Average this step's gradients here unless the optimizer will exchange them itself.

    Plain optimizers: always. Compressed ones: only on the steps they would average exactly
    (1-bit Adam's warm-up), so that clipping then acts on the average, as for Adam, and the
    warm-up equals Adam's run step for step. Returns True when the gradients are now the
    average on every rank (a NaN anywhere has then reached every rank).
    """
    if not getattr(opt, "averages_gradients", False):
        average_gradients(opt)
        return True
    if getattr(opt, "next_step_averages_exactly", False):
        average_gradients(opt)
        opt.grads_are_averaged()  # type: ignore[attr-defined]
        return True
    return False


def clip_gradients(model: GPT, max_norm: float) -> float:
    """Clip by the global gradient norm, the same on every rank.

    With expert parallelism each rank holds different experts: their squared norms are
    summed over the expert-parallel group so every rank computes the same total.
    """
    dense, expert = [], []
    for p in model.parameters():
        if p.grad is not None:
            (expert if is_expert_param(p) else dense).append(p.grad)
    sq = torch.zeros((), dtype=torch.float32)
    for g in dense:
        sq += g.float().pow(2).sum()
    if expert:
        esq = torch.zeros((), dtype=torch.float32)
        for g in expert:
            esq += g.float().pow(2).sum()
        if model.ep_groups is not None:  # its ep_group None means the whole world
            dist.all_reduce(esq, group=model.ep_groups.ep_group)
        sq += esq
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in dense + expert:
            g.mul_(coef)
    return norm


@torch.no_grad()
def evaluate(model: GPT, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], dtype: str,
             device: torch.device) -> float:
    """Mean validation loss in nats per byte over all windows (every rank computes the same
    number); batches may differ in size, e.g. the last one of ``moebit eval``'s split."""
    model.eval()
    total, windows = 0.0, 0
    for x, y in batches:
        with autocast(dtype, device):
            total += float(model(x.to(device), y.to(device)).loss) * len(x)
        windows += len(x)
    model.train()
    return total / windows


def autocast(dtype: str, device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def moe_metrics(ffn_outputs: list[Any]) -> dict[str, Any]:
    """Aux loss, drop rate and expert load of the MoE blocks of one forward pass."""
    out: dict[str, Any] = {}
    loads, drops = [], []
    for o in ffn_outputs:
        st = getattr(o, "stats", None)
        if st is None:
            continue
        loads.append([int(v) for v in st.tokens_per_expert.tolist()])
        drops.append(float(st.fraction_dropped))
    if loads:
        out["drop_rate"] = sum(drops) / len(drops)
        out["expert_load"] = loads
    return out


def run(cfg: TrainConfig, run_dir: Path) -> dict[str, Any]:
    info = init_from_env(cfg.device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    try:
        return _train(cfg, run_dir, info)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report_freeze(emit: Any, opt: torch.optim.Optimizer, step: int, frac: float,
                   rank: int) -> None:
    """Record the freeze, and warn when clipping was routine during the warm-up.

    Adam divides clipping's scale out again (m and sqrt(v) shrink alike). A frozen variance
    cannot: the momentum then comes from each rank's clipped local gradient, whose norm
    grows with gradient noise (more ranks, smaller batches), while v kept the scale of the
    clipped averages. So a clip that acts on most steps becomes a hidden learning-rate
    factor after the freeze (docs/optimizers.md: about 0.5x in our 2000-step run). A
    threshold that only catches spikes is safe.
    """
    emit({"kind": "freeze", "step": step, "optimizer": type(opt).__name__,
          "clipped_frac_before": frac})
    if frac > 0.5 and rank == 0:
        print(f"moebit: {type(opt).__name__} froze its variance after step {step}; gradient "
              f"clipping acted on {frac:.0%} of the steps before. With a frozen variance it now "
              "rescales every step (by each rank's local gradient norm): raise --grad-clip "
              "above the usual gradient norm or set it to 0. See docs/optimizers.md.",
              file=sys.stderr)


class NonFiniteLoss(RuntimeError):
    """The loss or the gradients became NaN or inf and ``on_nan`` says stop."""


def any_rank(flag: bool, local_grads: bool) -> bool:
    """Whether any rank saw ``flag``: the step is skipped everywhere or nowhere.

    With exact gradient averaging a NaN on one rank reaches every rank's gradients, so
    the local check suffices; the 1-bit optimizers exchange no gradients, so they pay
    one 4-byte allreduce per step for the verdict.
    """
    if not local_grads or not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    w = dist.get_world_size()
    stats.record("nan_check", stats.ring_allreduce_bytes(4, w), stats.ring_allreduce_bytes(4, w),
                 time.perf_counter() - t0)
    return bool(t.item() > 0)


def _train(cfg: TrainConfig, run_dir: Path, info: DistInfo) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data)
    check_block_size(corpus, cfg.block_size)
    model = GPT(cfg.model_config()).to(info.device)
    ep = model.ep_groups
    if ep is None:
        broadcast_params_(model)
    else:
        broadcast_params_(model, expert_dp_group=ep.expert_dp_group, expert_src=ep.expert_dp_ranks[0],
                          is_expert=is_expert_param)
    groups = param_groups(model, cfg)
    opt = make_optimizer(cfg, groups)
    batches = TrainBatches(corpus.train, cfg.block_size, cfg.batch_size, cfg.seed, info.rank)
    vbatches = val_batches(corpus.val, cfg.block_size, cfg.batch_size, cfg.eval_batches, cfg.seed)
    n_params = model.num_params()
    tokens_per_step = cfg.batch_size * cfg.block_size * info.world_size

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resumed = None
    if cfg.resume or restarted:
        resumed = ckpt_io.restore(run_dir, model, opt, batches, info, cfg)
    first_step = resumed.step if resumed else 0
    t_offset = resumed.wall if resumed else 0.0
    train_time = resumed.train_time if resumed else 0.0

    log = None
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resumed:
            ckpt_io.trim_metrics(run_dir / "metrics.jsonl", first_step)
        log = (run_dir / "metrics.jsonl").open("a")

    def emit(rec: dict[str, Any]) -> None:
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    if resumed:
        emit({"kind": "resume", "step": first_step, "from": str(resumed.path),
              "world_size": info.world_size, "resharded": resumed.resharded})
    else:
        emit({"kind": "start", "n_params": n_params, "world_size": info.world_size,
              "n_expert_params": model.num_expert_params(),
              "optimizer": cfg.optimizer, "unigram_entropy": corpus.unigram_entropy(),
              "corpus": corpus.source, "train_bytes": len(corpus.train),
              "val_bytes": len(corpus.val), "threads": torch.get_num_threads()})
    bar = None
    if info.is_main:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=first_step, desc="train", unit="step",
                   mininterval=1.0, file=sys.stderr, dynamic_ncols=True)
    t_start = time.perf_counter() - t_offset
    win_loss, win_aux, win_n, win_time = 0.0, 0.0, 0, 0.0
    win_norm, win_clipped = 0.0, 0
    clipped_steps = 0
    win_stats = stats.snapshot()
    val_loss = float("nan")
    last_moe: dict[str, Any] = {}
    postfix: dict[str, str] = {}
    nan_streak = nan_total = 0
    model.train()
    for step in range(first_step, cfg.steps):
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batches.next()
        x, y = x.to(info.device), y.to(info.device)
        with autocast(cfg.dtype, info.device):
            out = model(x, y)
        loss = out.loss + out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        averaged = average_for_step(opt)
        norm = clip_gradients(model, cfg.grad_clip)
        loss_value = float(out.loss.detach())
        if any_rank(not (math.isfinite(loss_value) and math.isfinite(norm)), not averaged):
            nan_streak += 1
            nan_total += 1
            emit({"kind": "nan", "step": step + 1, "loss": loss_value, "grad_norm": norm,
                  "action": cfg.on_nan})
            if cfg.on_nan == "stop" or nan_streak > cfg.max_nan_skips:
                why = ("--on-nan stop" if cfg.on_nan == "stop"
                       else f"{nan_streak} consecutive steps (max_nan_skips={cfg.max_nan_skips})")
                raise NonFiniteLoss(
                    f"non-finite loss or gradient at step {step + 1} (loss={loss_value}, "
                    f"grad norm={norm}); stopping: {why}"
                )
            opt.zero_grad(set_to_none=True)  # nothing of this step reaches the optimizer
            if bar is not None:
                bar.update(1)
            continue
        nan_streak = 0
        was_frozen = getattr(opt, "frozen_at", None) is not None
        opt.step()
        dt = time.perf_counter() - t0
        clipped_steps += int(cfg.grad_clip > 0 and norm > cfg.grad_clip)
        if not was_frozen and getattr(opt, "frozen_at", None) is not None:
            _report_freeze(emit, opt, step + 1, clipped_steps / (step + 1 - first_step), info.rank)
        train_time += dt
        win_time += dt
        win_loss += loss_value
        win_aux += float(out.aux_loss.detach())
        win_norm += norm
        win_clipped += int(cfg.grad_clip > 0 and norm > cfg.grad_clip)
        win_n += 1
        if cfg.num_experts:
            last_moe = moe_metrics(out.ffn_outputs)
        last = step == cfg.steps - 1
        if win_n and ((step + 1) % cfg.log_every == 0 or last):
            now = stats.snapshot()
            d = now.minus(win_stats)
            rec = {
                "kind": "train", "step": step + 1, "loss": win_loss / win_n, "lr": lr,
                "tokens_per_s": tokens_per_step * win_n / win_time,
                "bytes_sent": now.bytes_sent, "bytes_recv": now.bytes_recv,
                "step_bytes_sent": d.bytes_sent / win_n, "step_bytes_recv": d.bytes_recv / win_n,
                "comm_seconds_per_step": sum(o.seconds for o in d.ops.values()) / win_n,
                "wall": time.perf_counter() - t_start, "train_time": train_time,
                "comm_stage": getattr(opt, "comm_stage", "exact"),
                "collectives": d.calls,
                **stats.per_step_by_kind(d, win_n),
                # Before clipping; the norm of the average while gradients are averaged
                # exactly, of this rank's own gradient once a compressed optimizer froze.
                "grad_norm": win_norm / win_n, "clipped_frac": win_clipped / win_n,
            }
            if hasattr(opt, "comm_rounds"):
                rec["comm_rounds"] = opt.comm_rounds
            if cfg.num_experts:
                rec["aux_loss"] = win_aux / win_n
                rec.update(last_moe)
            emit(rec)
            if bar is not None:
                postfix.update(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                               MB_sent=f"{now.bytes_sent / 1e6:.1f}")
                bar.set_postfix(postfix, refresh=False)
            win_loss, win_aux, win_n, win_time, win_stats = 0.0, 0.0, 0, 0.0, now
            win_norm, win_clipped = 0.0, 0
        evaluating = (step + 1) % cfg.eval_every == 0 or last
        saving = last or (cfg.save_every and (step + 1) % cfg.save_every == 0)
        if last and hasattr(opt, "synchronize"):
            # 0/1 Adam's replicas drift between syncs: the run ends on one agreed model.
            # Earlier evaluations use each rank's own replica (rank 0's is logged), so that
            # evaluating or saving never changes the trajectory and resumes stay exact.
            opt.synchronize()
        if evaluating:
            val_loss = evaluate(model, vbatches, cfg.dtype, info.device)
            emit({"kind": "eval", "step": step + 1, "val_loss": val_loss,
                  "wall": time.perf_counter() - t_start, "train_time": train_time,
                  "bytes_sent": stats.snapshot().bytes_sent})
            if bar is not None:
                postfix["val"] = f"{val_loss:.3f}"
                bar.set_postfix(postfix, refresh=False)
        if saving:
            ckpt_io.save(run_dir, step + 1, model, opt, batches, info, cfg,
                         wall=time.perf_counter() - t_start, train_time=train_time)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if math.isnan(val_loss):  # resumed at the very end, or every late step was skipped
        val_loss = evaluate(model, vbatches, cfg.dtype, info.device)
    total = stats.snapshot()
    summary = {
        "kind": "end", "steps": cfg.steps, "val_loss": val_loss, "n_params": n_params,
        "unigram_entropy": corpus.unigram_entropy(), "wall": time.perf_counter() - t_start,
        "train_time": train_time, "bytes_sent": total.bytes_sent, "bytes_recv": total.bytes_recv,
        "tokens_per_s": tokens_per_step * max(1, cfg.steps - first_step) / max(train_time, 1e-9),
        "frozen_at": getattr(opt, "frozen_at", None), "nan_skipped": nan_total,
        "collectives": total.calls, "comm_rounds": getattr(opt, "comm_rounds", None),
        "bytes_sent_by_kind": {k: o.bytes_sent for k, o in total.by_kind().items()},
    }
    if cfg.samples:
        from moebit.inference import generate

        texts = generate(model, SAMPLE_PROMPTS[: cfg.samples], max_new_tokens=120, seed=cfg.seed)
        summary["samples"] = [p + t for p, t in zip(SAMPLE_PROMPTS, texts, strict=False)]
    emit(summary)
    if log is not None:
        log.close()
    if info.is_main:
        from moebit.report import plot_runs

        plot_runs([run_dir], run_dir)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moebit.train", description=__doc__)
    ap.add_argument("--resolved-config", required=True,
                    help="config.json written by `moebit train` into the run folder")
    args = ap.parse_args(argv)
    path = Path(args.resolved_config)
    cfg = build(json.loads(path.read_text()), source=str(path))
    summary = run(cfg, path.parent)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "samples"}))
        for s in summary.get("samples", []):
            print("---\n" + s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
