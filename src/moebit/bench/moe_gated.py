"""``moebit bench moe``'s SwiGLU implementations and the Hugging Face peer.

All SwiGLU rows run dropless at expert width ``d_ffn_gated`` (default 1360: three
[512, 1360] projections cost what two [512, 2048] ones do), because Mixtral's block has
no capacity: every implementation then multiplies exactly the same rows.

- ``lower_bound_swiglu``: the compute floor: the float32 router (linear, softmax, top-k)
  plus each expert's gated MLP (``F.linear`` with the fused [2f, d] gate_up weight, SiLU
  times up, ``F.linear`` down) on exactly its tokens, pre-gathered, with per-expert leaf
  weights. No dispatch, no combine.
- ``moebit_swiglu`` (``kernel="auto"``), ``moebit_swiglu_loop`` / ``_padded`` / ``_grouped``:
  ``moebit.moe.MoE`` with ``expert_type="swiglu"``, each kernel forced.
- ``hf_eager`` / ``hf_grouped_mm``: transformers' ``MixtralSparseMoeBlock`` (optional: skipped
  with a message when transformers is not importable) with ``_experts_implementation``
  "eager" (a loop over the experts hit) or "grouped_mm" (``torch.nn.functional.grouped_mm``
  with torch's autograd). Our router and expert weights are copied in, so all route alike
  (in bf16 Mixtral's router runs in bf16, so a few near-ties may route differently).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebit.moe import MoE, MoEConfig, plan_dispatch

GATED_IMPLS = ("lower_bound_swiglu", "moebit_swiglu", "moebit_swiglu_loop",
               "moebit_swiglu_padded", "moebit_swiglu_grouped", "hf_eager", "hf_grouped_mm")



def routed_blocks(moe: MoE, x: torch.Tensor, n_experts: int):
    """What a compute floor starts from: the layer's routing plan, a holder module with its
    router, and each expert's rows of ``x`` as a separate leaf block (no dispatch cost)."""
    with torch.no_grad():
        r = moe.gate(x)
        plan = plan_dispatch(r.expert_SK, r.weight_SK, r.kept_SK, n_experts)
    holder = nn.Module()
    holder.router = moe.gate.router
    blocks = [b.detach().clone().requires_grad_(True)
              for b in x.detach().index_select(0, plan.token_N).split(plan.counts)]
    return plan, holder, blocks

def _swiglu_layer(spec: dict[str, Any], x: torch.Tensor, kernel: str = "auto") -> MoE:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=spec["experts"], num_experts_per_tok=spec["k"],
                    drop_tokens=False, d_ffn=spec["d_ffn_gated"], expert_type="swiglu",
                    kernel=kernel)
    return MoE(spec["d_model"], cfg).to(x.dtype)


def _ours(kernel: str):
    def build(spec: dict[str, Any], x: torch.Tensor):
        moe = _swiglu_layer(spec, x, kernel)
        return (lambda: [moe(x).hidden]), moe
    return build


def _lower_bound(spec: dict[str, Any], x: torch.Tensor):
    """Router + per-expert gated MLPs on pre-gathered blocks of exactly the routed tokens."""
    moe = _swiglu_layer(spec, x)
    plan, holder, blocks = routed_blocks(moe, x, spec["experts"])
    ex = moe.experts
    holder.w = nn.ParameterList()
    for e in range(spec["experts"]):
        holder.w.append(nn.Parameter(ex.gate_up_proj[e].detach().clone()))
        holder.w.append(nn.Parameter(ex.down_proj[e].detach().clone()))
    k = spec["k"]

    def step() -> list[torch.Tensor]:
        logits = F.linear(x.float(), holder.router.weight.float())
        outs = [torch.topk(torch.softmax(logits, -1), k, dim=-1).values]
        for e, xb in enumerate(blocks):
            if xb.shape[0]:
                gate, up = F.linear(xb, holder.w[2 * e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, holder.w[2 * e + 1]))
        return outs

    return step, holder


def _hf(implementation: str):
    def build(spec: dict[str, Any], x: torch.Tensor):
        try:  # optional peer (the "peers" extra): skipped with this message when absent
            from transformers import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        except ImportError as e:
            raise RuntimeError(f"transformers is not importable ({e}); peer skipped") from e
        cfg = MixtralConfig(hidden_size=spec["d_model"], intermediate_size=spec["d_ffn_gated"],
                            num_local_experts=spec["experts"],
                            num_experts_per_tok=spec["k"], router_jitter_noise=0.0)
        cfg._experts_implementation = implementation
        block = MixtralSparseMoeBlock(cfg)
        ours = _swiglu_layer(spec, x)
        with torch.no_grad():
            block.gate.weight.copy_(ours.gate.router.weight)
            block.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
            block.experts.down_proj.copy_(ours.experts.down_proj)
        block = block.to(x.dtype)
        x3 = x.view(1, *x.shape)
        return (lambda: [block(x3)]), block
    return build


GATED_BUILDERS = {
    "lower_bound_swiglu": _lower_bound,
    "moebit_swiglu": _ours("auto"),
    "moebit_swiglu_loop": _ours("loop"),
    "moebit_swiglu_padded": _ours("padded"),
    "moebit_swiglu_grouped": _ours("grouped"),
    "hf_eager": _hf("eager"),
    "hf_grouped_mm": _hf("grouped_mm"),
}

# Each row's floor: ``fb / LB`` is its forward+backward time over this implementation's.
FLOOR_OF = {impl: "lower_bound_swiglu" for impl in GATED_IMPLS}


def summarize(by_impl: dict[str, dict[str, Any]], key: str = "fwd_bwd_ms") -> dict[str, float]:
    """The issue's ratios for one (E, k, dtype): floors, the HF peer, auto against the best.

    ``key`` "fwd_bwd_ms" compares medians, "fwd_bwd_min_ms" minima (less hit by load bursts).
    """
    fb = {i: r[key] for i, r in by_impl.items() if key in r}
    out: dict[str, float] = {}

    def ratio(name: str, a: str, b: str) -> None:
        if a in fb and b in fb:
            out[name] = fb[a] / fb[b]

    ratio("swiglu_over_floor", "moebit_swiglu", "lower_bound_swiglu")
    ratio("hf_grouped_mm_over_swiglu", "hf_grouped_mm", "moebit_swiglu")
    ratio("hf_eager_over_swiglu", "hf_eager", "moebit_swiglu")
    ratio("gelu_over_floor", "moebit", "lower_bound")
    for auto, prefix in (("moebit_swiglu", "moebit_swiglu_"), ("moebit", "moebit_")):
        kernels = [fb[prefix + k] for k in ("loop", "padded", "grouped") if prefix + k in fb]
        if auto in fb and kernels:
            out[f"{auto}_auto_over_best_kernel"] = fb[auto] / min(kernels)
    return out
