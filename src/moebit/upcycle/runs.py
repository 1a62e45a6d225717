"""Sparse upcycling of a moebit run: a dense checkpoint becomes an MoE one.

The algorithm is ``moebit.upcycle.core`` (experts copy the dense MLP, routers start near
zero); this front end maps moebit's GPT names and layouts (experts stacked [E, d, f], the
dense Linear's weight [f, d]) and writes the result as an ordinary run folder: config.json
(the dense run's settings with the MoE ones) and a complete checkpoint at the dense run's
step, whose shards carry the dense run's data-stream position and RNG state and a fresh
optimizer state (the dense moments do not fit the new parameters). ``moebit train
--resume OUT --steps N`` continues it: N counts the dense steps too, so the learning-rate
schedule resumes where it stood at N.

    upcycle("runs/dense", "runs/moe", num_experts=8, settings={"num_experts_per_tok": 2})
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moebit.checkpoint import (
    CheckpointError,
    load_file,
    read_manifest,
    save_atomic,
    sha256_of,
    shard_name,
    step_dir,
    verify,
    write_manifest,
    write_text_atomic,
)
from moebit.inference.loading import model_config_of, resolve_checkpoint
from moebit.models.gpt import GPTConfig, moe_config_for
from moebit.models.gpt_family import GPT_FAMILY
from moebit.models.interface import CausalLM
from moebit.training.config import TrainConfig, build
from moebit.training.setup import make_optimizer, param_groups
from moebit.training.state import optimizer_state
from moebit.upcycle.core import ExpertCopier, warn_unless_dense

# Expert tensor -> (dense MLP tensor, transpose?): Experts hold x @ w1 [d, f], the dense
# Linear holds weight [f, d].
_EXPERT_SOURCES = {"w1": ("fc.weight", True), "b1": ("fc.bias", False),
                   "w2": ("proj.weight", True), "b2": ("proj.bias", False)}
_NOISY = ("w1", "w2")  # noise goes on the weight matrices, not on the biases


def _expert_copies(dense: dict[str, torch.Tensor], src: str, template: dict[str, torch.Tensor],
                   dst: str, copier: ExpertCopier) -> dict[str, torch.Tensor]:
    """The expert tensors under ``dst`` (``...experts.``), each a copy of the dense MLP."""
    out = {}
    for key in (k for k in template if k.startswith(dst)):
        name = key[len(dst):]
        if name not in _EXPERT_SOURCES:
            raise ValueError(f"upcycle: no dense counterpart for expert tensor {key!r} "
                             "(only GELU-MLP experts with biases copy a dense MLP)")
        dense_key, transpose = _EXPERT_SOURCES[name]
        w = dense[src + dense_key]
        w = w.t() if transpose else w
        shape = template[key].shape
        if tuple(w.shape) != tuple(shape[1:]):
            raise ValueError(f"upcycle: {src + dense_key} {tuple(w.shape)} does not fit {key} "
                             f"{tuple(shape)}")
        out[key] = copier.experts(w, shape[0], noisy=name in _NOISY)
    return out


def upcycle_state_dict(dense: dict[str, torch.Tensor], cfg: GPTConfig, *, noise_std: float = 0.0,
                       router_std: float = 1e-3, seed: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of ``GPT(cfg)`` (MoE, ep_size 1) built from a dense GPT's state dict.

    Shared tensors (attention, norms, embeddings, dense blocks) are copied; each MoE block's
    experts copy its dense MLP, its router is N(0, router_std), a Residual-MoE block also
    copies the MLP into its dense branch and mixes the two halves equally, and selection
    biases start at 0. Every tensor of the result is accounted for, or this raises naming it.
    """
    if not cfg.is_moe:
        raise ValueError("upcycle: the target config has no MoE blocks (num_experts is 0)")
    copier = ExpertCopier(noise_std, router_std, seed)
    template = GPT_FAMILY.build(cfg, device="meta").state_dict()  # names and shapes only
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for layer in cfg.moe_layers():
        src, ffn = f"blocks.{layer}.ffn.", f"blocks.{layer}.ffn."
        moe = ffn + "moe." if moe_config_for(cfg, layer).residual else ffn
        if moe != ffn:  # Residual MoE: the dense branch is the MLP itself, mixed 50/50
            for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
                out[ffn + "mlp." + name] = dense[src + name].clone()
            for name in ("coef.weight", "coef.bias"):
                out[ffn + name] = torch.zeros(template[ffn + name].shape,
                                              dtype=template[ffn + name].dtype)
        out.update(_expert_copies(dense, src, template, moe + "experts.", copier))
        router = template[moe + "gate.router.weight"]
        out[moe + "gate.router.weight"] = copier.router(tuple(router.shape), router.dtype)
        bias = template.get(moe + "gate.e_score_correction_bias")
        if bias is not None:
            out[moe + "gate.e_score_correction_bias"] = torch.zeros(bias.shape, dtype=bias.dtype)
        used.update(src + n for n in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"))
    for key, t in template.items():
        if key in out:
            continue
        if key not in dense or dense[key].shape != t.shape:
            raise ValueError(f"upcycle: the dense checkpoint has no tensor for {key!r} "
                             f"{tuple(t.shape)}: is it the same model apart from the MoE blocks?")
        out[key] = dense[key].clone()
        used.add(key)
    unused = sorted(set(dense) - used)
    if unused:
        raise ValueError(f"upcycle: dense tensors with no place in the MoE model: {unused[:4]}")
    return out


def weights_sum_to_one(cfg: GPTConfig) -> bool:
    """Whether every MoE block's k gate weights sum to 1 (the upcycled model = the dense one)."""
    for layer in cfg.moe_layers():
        m = moe_config_for(cfg, layer)
        normalised = not m.softmax_before_topk or (m.norm_topk_prob and m.k > 1)
        if not normalised or m.routed_scaling_factor != 1.0:
            return False
    return True


def upcycled_config(dense_cfg: dict[str, Any], num_experts: int | list[int],
                    moe_every: int | None, settings: dict[str, Any] | None,
                    run_dir: Path) -> TrainConfig:
    """The dense run's training config made MoE (expert-parallel size 1; --resume may
    raise it: the checkpoint is resharded)."""
    values = {k: v for k, v in dense_cfg.items() if k != "resume"}
    values.update(num_experts=num_experts, ep_size=1, run_dir=str(run_dir))
    if moe_every is not None:
        values["moe_every"] = moe_every
    values.update(settings or {})
    return build(values, source="upcycle settings")


def _fresh_shard(model: CausalLM, cfg: TrainConfig, dense_shard: dict[str, Any],
                 state: dict[str, torch.Tensor]) -> dict[str, Any]:
    opt = make_optimizer(cfg, param_groups(model, cfg))
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {**dense_shard, "model": state, "optimizer": optimizer_state(opt),
            "optimizer_param_names": [[name_of[id(p)] for p in g["params"]]
                                      for g in opt.param_groups]}


def upcycle(run: str | Path, out: str | Path, num_experts: int | list[int], *,
            moe_every: int | None = None, noise_std: float = 0.0, router_std: float = 1e-3,
            settings: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """Write an upcycled copy of dense ``run`` (a run or checkpoint folder) as run ``out``.

    ``settings`` are further training-config keys for the MoE run (``num_experts_per_tok``,
    ``capacity_factor``, ``bias_update_speed``...). Returns the new checkpoint folder.
    """
    d = resolve_checkpoint(run)
    manifest = read_manifest(d)
    if model_config_of(manifest, d).is_moe:
        raise ValueError(f"upcycle: {d} already holds an MoE model")
    out = Path(out)
    if (out / "metrics.jsonl").exists() or (out / "checkpoints").exists():
        raise ValueError(f"upcycle: --run-dir {str(out)!r} already holds a run: pick another folder")
    cfg = upcycled_config(manifest["config"], num_experts, moe_every, settings, out)
    gcfg = cfg.model_config()
    warn_unless_dense(weights_sum_to_one(gcfg), noise_std)
    verify(d, manifest)
    shards = [load_file(d / shard_name(r)) for r in range(manifest["world_size"])]
    state = upcycle_state_dict(shards[0]["model"], gcfg, noise_std=noise_std,
                               router_std=router_std, seed=seed)
    model = GPT_FAMILY.build(gcfg)
    model.load_state_dict(state)  # strict: every tensor present and of the right shape
    step = int(manifest["step"])
    new = step_dir(out, step)
    new.mkdir(parents=True, exist_ok=True)
    files = {}
    for r, shard in enumerate(shards):
        if shard.get("rank", r) != r:
            raise CheckpointError(f"{d / shard_name(r)} holds rank {shard.get('rank')}'s shard")
        path = new / shard_name(r)
        save_atomic(_fresh_shard(model, cfg, shard, state), path)
        files[shard_name(r)] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    write_text_atomic(json.dumps(cfg.to_dict(), indent=2) + "\n", out / "config.json")
    sizes = {"n_params": model.num_params(), "n_expert_params": model.num_expert_params()}
    _copy_metrics(d.parent.parent / "metrics.jsonl", out / "metrics.jsonl", step, sizes,
                  {"kind": "upcycle", "step": step, "from": str(d), "num_experts": num_experts,
                   "noise_std": noise_std, "router_std": router_std, **sizes})
    write_manifest(new, {"step": step, "world_size": manifest["world_size"], "ep_size": 1,
                         "optimizer": cfg.optimizer, "model_config": gcfg.to_dict(),
                         "config": cfg.to_dict(), "files": files, "upcycled_from": str(d)})
    return new


def _copy_metrics(src: Path, dst: Path, step: int, sizes: dict[str, int],
                  record: dict[str, Any]) -> None:
    """The dense run's records up to ``step`` (its curve), then the upcycling record; the
    start record gets the MoE model's sizes (``moebit report`` reads them there)."""
    lines = []
    if src.is_file():
        for line in src.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("kind") == "start":
                    rec = {**rec, "dense_n_params": rec.get("n_params"), **sizes}
                    line = json.dumps(rec)
                if rec.get("kind") != "end" and rec.get("step", 0) <= step:
                    lines.append(line)
    lines.append(json.dumps(record))
    write_text_atomic("\n".join(lines) + "\n", dst)
