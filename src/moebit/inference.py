"""Batched KV-cache generation for dense, MoE and PR-MoE GPTs, on one rank or many.

    model = load_model("runs/a")                       # newest checkpoint of a run
    texts = generate(model, ["def ", "class "], max_new_tokens=64, temperature=0)

Why a decoding loop of its own rather than ``model(idx, caches=...)``: prompts of a batch
have different lengths, so they are left-padded and every row needs its own positions and
a key mask; the cache is allocated once ([B, H, T_max, Dh] per block, written in place)
instead of growing by ``torch.cat`` every step; and the feed-forward of every block runs
only on the tokens that matter (no padding, no finished rows), so an MoE layer routes and
ships nothing it does not need. The blocks' own modules (ln, qkv, proj, ffn) do the work.

Routing never drops a token here: ``dropless(model)`` turns every gate dropless for the
duration (an expert's capacity is a training device; at inference a dropped token is a
wrong token).

Many ranks (``torch.distributed`` initialised, e.g. by ``moebit generate --nproc N``):
the prompts are split across ranks (data parallel) and the texts gathered back, so every
rank returns the full list. An expert-parallel model (built with ``ep_size > 1``) holds
E/ep experts per rank and its MoE layers exchange tokens over all-to-all inside every
forward, so all ranks must run the same number of forwards: each global step every rank
runs one (a prefill, a decode step, or an empty forward that only serves its experts),
and a one-int allreduce per step tells everyone whether any rank still has work. A rank
whose sequences are finished keeps serving until then (DeepSpeed hangs there, #6634).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moebit.checkpoint import MANIFEST, CheckpointError, latest, read_manifest
from moebit.models.gpt import GPT, GPTConfig

NEWLINE = 10  # an empty prompt starts from a newline byte


# ----------------------------------------------------------------------------- loading


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder (its newest complete checkpoint) or a checkpoint folder, else a clear error."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    if p.is_file():
        raise CheckpointError(
            f"{p} is a file, not a moebit run or checkpoint folder (expected RUN/ or "
            f"RUN/checkpoints/step-N/ holding {MANIFEST})"
        )
    if (p / MANIFEST).is_file():
        return p
    if (p / "checkpoints").is_dir() or (p / "config.json").is_file():
        d = latest(p)
        if d is None:
            raise CheckpointError(f"run {p} has no complete checkpoint (none with a {MANIFEST})")
        return d
    raise CheckpointError(
        f"{p} is not a moebit run or checkpoint folder: no {MANIFEST}, config.json or checkpoints/"
    )


def model_config_of(manifest: dict, where: Path) -> GPTConfig:
    """The GPTConfig saved in a manifest; another kind of checkpoint is named as such."""
    mc = manifest.get("model_config")
    if not isinstance(mc, dict) or "ep_size" not in manifest or "files" not in manifest:
        raise CheckpointError(
            f"{where / MANIFEST} is not a moebit GPT checkpoint (no model_config / ep_size / files)"
        )
    try:
        return GPTConfig(**mc)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} holds another model type: its model_config does not "
                              f"describe a moebit GPT ({e})") from None


def load_model(
    path: str | Path, ep_size: int = 1, rank: int = 0, dtype: torch.dtype | None = None
) -> GPT:
    """Build the GPT a checkpoint was saved from and load its weights, in eval mode.

    ``ep_size > 1`` splits every MoE layer's experts over that many ranks (the process
    group must be initialised; call on every rank); this rank keeps the slice of
    ``rank % ep_size``. Raises ``CheckpointError`` naming the problem for a missing,
    incomplete, corrupted or foreign checkpoint.
    """
    from moebit.checkpoint.train_state import load_model_weights

    d = resolve_checkpoint(path)
    manifest = read_manifest(d)
    cfg = model_config_of(manifest, d)
    if cfg.is_moe:
        cfg.moe = cfg.moe.replace(ep_size=ep_size)
    elif ep_size > 1:
        raise ValueError(f"{d} holds a dense model: expert parallelism (ep_size {ep_size}) needs experts")
    model = GPT(cfg)
    try:
        load_model_weights(d, manifest, model, rank, ep_size if cfg.is_moe else 1)
    except KeyError as e:
        raise CheckpointError(f"{d} is not a moebit GPT checkpoint (missing entry {e})") from None
    except RuntimeError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{d} holds weights of another model: {str(e).splitlines()[0]}") from None
    if dtype is not None:
        model.to(dtype)
    return model.eval()


# ----------------------------------------------------------------------------- routing


@contextmanager
def dropless(model: torch.nn.Module) -> Iterator[None]:
    """Every MoE gate of ``model`` routes every token while inside; settings restored after."""
    from moebit.moe import TopKGate

    saved = [(g.config, g.config.drop_tokens) for g in model.modules() if isinstance(g, TopKGate)]
    for c, _ in saved:
        c.drop_tokens = False
    try:
        yield
    finally:
        for c, old in saved:
            c.drop_tokens = old


# ----------------------------------------------------------------------------- decoding


def route(moe: torch.nn.Module, x_SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's top-k choice (experts [S, k], weights [S, k]) without its losses and
    statistics (``TopKGate.choose``); the model is in eval mode, so no routing noise."""
    _, _, expert_SK, weight_SK = moe.gate.choose(x_SD)
    return expert_SK, weight_SK


def moe_infer(moe: torch.nn.Module, x_SD: torch.Tensor) -> torch.Tensor:
    """An ``MoE`` layer's output for tokens [S, d], dropless, through its own experts and
    (expert parallel) its all-to-all; [0, d] still takes part in the collectives."""
    from moebit.moe import expert_parallel_apply, permute, plan_dispatch, unpermute

    expert_SK, weight_SK = route(moe, x_SD)
    kept_SK = torch.ones_like(expert_SK, dtype=torch.bool)
    plan = plan_dispatch(expert_SK, weight_SK, kept_SK, moe.config.num_experts)
    x_ND = permute(x_SD, plan)
    if moe.ep_groups is not None:
        y_ND = expert_parallel_apply(x_ND, plan.counts_E, moe.experts, moe.ep_groups.ep_group)
    else:
        y_ND = moe.experts(x_ND, plan.counts)
    return unpermute(y_ND, plan).to(x_SD.dtype)


def ffn_infer(ffn: torch.nn.Module, x_SD: torch.Tensor) -> torch.Tensor:
    """A block's feed-forward output for inference: MoE and Residual MoE through their ``infer``."""
    from moebit.moe import MoE, ResidualMoE

    if isinstance(ffn, (MoE, ResidualMoE)):
        return ffn.infer(x_SD)  # routed experts plus shared experts / the residual mix
    out = ffn(x_SD)
    return out if isinstance(out, torch.Tensor) else out.hidden


@dataclass
class _Cache:
    """Preallocated keys/values for a batch: per block [B, H, T_max, Dh], ``filled`` columns used."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    start_B: torch.Tensor  # first real column of each row (left padding before it)
    filled: int = 0


def _new_cache(model: GPT, batch: int, length: int, start_B: torch.Tensor) -> _Cache:
    cfg = model.config
    p = model.wte.weight
    shape = (batch, cfg.n_head, length, cfg.d_model // cfg.n_head)
    ks = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in model.blocks]
    vs = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in model.blocks]
    return _Cache(ks, vs, start_B)


def _attn_mask(cache: _Cache, t: int, padded: bool) -> torch.Tensor | None:
    """[B, 1, T, S] bool: a query sees real keys up to itself. None where no row is padded
    and T == 1 (the plain path is faster). A pad query also sees itself, so no row of the
    softmax is empty (an all-masked row is NaN, and NaN times a zero weight stays NaN)."""
    t0, s = cache.filled, cache.filled + t
    if not padded and t == 1:
        return None
    dev = cache.start_B.device
    key_S = torch.arange(s, device=dev)
    query_T = torch.arange(t0, s, device=dev)
    causal_TS = key_S[None, :] <= query_T[:, None]
    real_BS = key_S[None, :] >= cache.start_B[:, None]
    self_TS = key_S[None, :] == query_T[:, None]
    return ((real_BS[:, None, :] & causal_TS[None]) | self_TS[None])[:, None]


def _forward(
    model: GPT, idx_BT: torch.Tensor, pos_BT: torch.Tensor, cache: _Cache,
    run_ffn_BT: torch.Tensor, padded: bool,
) -> torch.Tensor:
    """One prefill or decode step; returns the last column's logits [B, V] (float32)."""
    b, t = idx_BT.shape
    x_BTD = model.wte(idx_BT) + model.wpe(pos_BT)
    mask = _attn_mask(cache, t, padded)
    t0, t1 = cache.filled, cache.filled + t
    ffn_rows = run_ffn_BT.reshape(-1).nonzero().squeeze(1)
    all_rows = ffn_rows.numel() == b * t
    for i, block in enumerate(model.blocks):
        attn = block.attn
        d = x_BTD.shape[-1]
        q, k, v = attn.qkv(block.ln1(x_BTD)).split(d, dim=2)
        shape = (b, t, attn.n_head, d // attn.n_head)
        q_BHTd, k_BHTd, v_BHTd = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        cache.k[i][:, :, t0:t1] = k_BHTd
        cache.v[i][:, :, t0:t1] = v_BHTd
        keys, vals = cache.k[i][:, :, :t1], cache.v[i][:, :, :t1]
        if mask is None and t0 == 0:
            y = F.scaled_dot_product_attention(q_BHTd, keys, vals, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q_BHTd, keys, vals, attn_mask=mask)
        x_BTD = x_BTD + attn.proj(y.transpose(1, 2).reshape(b, t, d))
        h_ND = block.ln2(x_BTD).reshape(b * t, d)
        if all_rows:
            x_BTD = x_BTD + ffn_infer(block.ffn, h_ND).view(b, t, d)
        else:
            out_ND = ffn_infer(block.ffn, h_ND.index_select(0, ffn_rows))
            x_BTD = x_BTD.reshape(b * t, d).index_add(0, ffn_rows, out_ND.to(x_BTD.dtype)).view(b, t, d)
    cache.filled = t1
    return model.lm_head(model.ln_f(x_BTD[:, -1])).float()


def _idle_forward(model: GPT) -> None:
    """Serve this rank's experts for one step with no tokens of its own (expert parallel)."""
    p = model.wte.weight
    empty_0D = p.new_empty(0, model.config.d_model)
    for block in model.blocks:
        ffn_infer(block.ffn, empty_0D)


def _sample(logits_BV: torch.Tensor, temperature: float, top_k: int | None,
            gens: Sequence[torch.Generator]) -> list[int]:
    if temperature == 0:
        return logits_BV.argmax(-1).tolist()
    logits_BV = logits_BV.cpu() / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    # one generator per prompt: a prompt's text does not depend on its batch or rank
    return [int(torch.multinomial(probs_BV[i], 1, generator=g)) for i, g in enumerate(gens)]


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens of each prompt, in prompt order
    prefill_s: float = 0.0  # this rank's time in prefill forwards
    decode_s: float = 0.0  # this rank's time in decode forwards (sampling included)
    decode_steps: int = 0  # decode forwards this rank ran with live rows
    global_steps: int = 0  # forwards run in lockstep (expert parallel), idle ones included
    per_step_s: list[float] = field(default_factory=list)  # wall time of each decode step


class _BatchRun:
    """One mini-batch of prompts being decoded: left-padded ids, cache, per-row state."""

    def __init__(self, model: GPT, prompts: list[list[int]], budgets: list[int],
                 gens: list[torch.Generator], stop: bytes | None) -> None:
        dev = model.wte.weight.device
        self.model, self.budgets, self.gens, self.stop = model, budgets, gens, stop
        lens = [len(p) for p in prompts]
        tmax = max(lens)
        self.lens_B = torch.tensor(lens, device=dev)
        start_B = tmax - self.lens_B
        self.padded = bool((start_B > 0).any())
        self.cache = _new_cache(model, len(prompts), tmax + max(budgets), start_B)
        ids = torch.zeros(len(prompts), tmax, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, tmax - len(p):] = torch.tensor(p, device=dev)
        self.ids_BT = ids
        self.new: list[list[int]] = [[] for _ in prompts]
        self.live = [b > 0 for b in budgets]
        self.prefilled = False

    @property
    def done(self) -> bool:
        return not any(self.live)

    def step(self, temperature: float, top_k: int | None) -> None:
        m, c = self.model, self.cache
        dev = self.ids_BT.device
        if not self.prefilled:
            t = self.ids_BT.shape[1]
            pos_BT = (torch.arange(t, device=dev)[None] - c.start_B[:, None]).clamp_min(0)
            real_BT = torch.arange(t, device=dev)[None] >= c.start_B[:, None]
            logits = _forward(m, self.ids_BT, pos_BT, c, real_BT, self.padded)
            self.prefilled = True
        else:
            last = [r[-1] if r else 0 for r in self.new]
            idx_B1 = torch.tensor(last, device=dev)[:, None]
            pos_B1 = (self.lens_B + torch.tensor([len(r) for r in self.new], device=dev) - 1)[:, None]
            live_B1 = torch.tensor(self.live, device=dev)[:, None]
            logits = _forward(m, idx_B1, pos_B1, c, live_B1, self.padded)
        nxt = _sample(logits, temperature, top_k, self.gens)
        for i, tok in enumerate(nxt):
            if not self.live[i]:
                continue
            self.new[i].append(tok)
            if len(self.new[i]) >= self.budgets[i] or (
                self.stop and bytes(self.new[i][-len(self.stop):]) == self.stop
            ):
                self.live[i] = False


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _any_rank_busy(busy: bool) -> bool:
    t = torch.tensor([1 if busy else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


@torch.no_grad()
def generate_tokens(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    batch_size: int = 32,
    stop: bytes | None = None,
    shard: bool | None = None,
) -> GenerationResult:
    """Token-level generation; see ``generate``. Prompts are lists of byte ids."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    bs = model.config.block_size
    ids_all = [list(p)[-(bs - 1):] or [NEWLINE] for p in prompts]
    budgets_all = [min(max_new_tokens, bs - len(p)) for p in ids_all]
    distributed = _is_distributed()
    lockstep = distributed and model.ep_groups is not None
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    if shard is None:
        shard = distributed
    mine = list(range(len(ids_all)))
    if shard and world > 1:
        per = -(-len(ids_all) // world)
        mine = mine[rank * per:(rank + 1) * per]
    batches = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    res = GenerationResult(tokens=[])
    out: dict[int, list[int]] = {}
    was_training = model.training
    model.eval()
    try:
        with dropless(model):
            queue = list(batches)
            run: _BatchRun | None = None
            current: list[int] = []
            while True:
                if run is None or run.done:
                    if run is not None:
                        out.update(zip(current, run.new, strict=True))
                    run = None
                    while queue and run is None:
                        current = queue.pop(0)
                        gens = [torch.Generator().manual_seed(seed * 1_000_003 + j) for j in current]
                        r = _BatchRun(model, [ids_all[j] for j in current],
                                      [budgets_all[j] for j in current], gens, stop)
                        if r.done:  # nothing to generate (max_new_tokens 0)
                            out.update(zip(current, r.new, strict=True))
                        else:
                            run = r
                busy = run is not None
                if lockstep and not _any_rank_busy(busy):
                    break
                if not lockstep and not busy:
                    break
                res.global_steps += 1
                if not busy:
                    _idle_forward(model)
                    continue
                t0 = time.perf_counter()
                prefill = not run.prefilled
                run.step(temperature, top_k)
                dt = time.perf_counter() - t0
                if prefill:
                    res.prefill_s += dt
                else:
                    res.decode_s += dt
                    res.decode_steps += 1
                    res.per_step_s.append(dt)
    finally:
        model.train(was_training)
    if shard and world > 1:
        gathered: list[dict[int, list[int]] | None] = [None] * world
        dist.all_gather_object(gathered, out)
        for g in gathered:
            out.update(g or {})
    res.tokens = [out[j] for j in range(len(ids_all))]
    return res


def generate(
    model: GPT,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    use_cache: bool = True,
    batch_size: int = 32,
    stop: str | None = None,
    shard: bool | None = None,
) -> list[str]:
    """Continue each prompt; returns the continuations (without the prompt), in order.

    ``temperature=0`` is greedy. Sampling uses one generator per prompt (seeded from
    ``seed`` and the prompt's index), so a prompt's text does not depend on the batch it
    was decoded in, nor on the rank. ``batch_size`` prompts are decoded together;
    ``stop``: a row ends once its text ends with this string (kept in the output).
    ``shard`` (default: whenever a process group of more than one rank is up): split the
    prompts across ranks and gather the texts; every rank must call with the same prompts.
    ``use_cache=False`` recomputes the whole sequence every step, one prompt at a time,
    through the model's own forward (slow: the reference the cache is tested against).
    """
    ids = [list(p.encode("utf-8")) for p in prompts]
    stop_b = stop.encode("utf-8") if stop else None
    if use_cache:
        toks = generate_tokens(model, ids, max_new_tokens, temperature, top_k, seed,
                               batch_size, stop_b, shard).tokens
    else:
        toks = _generate_recompute(model, ids, max_new_tokens, temperature, top_k, seed, stop_b)
    return [bytes(t).decode("utf-8", errors="replace") for t in toks]


@torch.no_grad()
def _generate_recompute(model: GPT, prompts: list[list[int]], max_new_tokens: int,
                        temperature: float, top_k: int | None, seed: int,
                        stop: bytes | None) -> list[list[int]]:
    """No cache, no batching, no sharding: every rank runs every prompt the same way."""
    bs = model.config.block_size
    dev = model.wte.weight.device
    was_training = model.training
    model.eval()
    outs = []
    try:
        with dropless(model):
            for j, p in enumerate(prompts):
                ids = list(p)[-(bs - 1):] or [NEWLINE]
                gen = torch.Generator().manual_seed(seed * 1_000_003 + j)
                new: list[int] = []
                for _ in range(min(max_new_tokens, bs - len(ids))):
                    idx = torch.tensor([ids + new], device=dev)
                    logits = model(idx).logits[:, -1].float()
                    new.append(_sample(logits, temperature, top_k, [gen])[0])
                    if stop and bytes(new[-len(stop):]) == stop:
                        break
                outs.append(new)
    finally:
        model.train(was_training)
    return outs
