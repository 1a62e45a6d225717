"""The Hugging Face MoE decoder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, FlexOlmo, GLM-4.5 MoE,
MiniMax-M2, gpt-oss, DeepSeek-V3/V2) on moebit's parts; gpt-oss's sinks and sliding windows:
``sinks.py``; DeepSeek's multi-head latent attention and its compressed latent cache: ``mla.py``.

Pre-norm blocks: RMSNorm, grouped-query attention with rotary embeddings (and the
families' q/k norms), RMSNorm, then a SwiGLU MLP or a ``moebit.moe.MoE`` block (dropless,
SwiGLU experts in transformers 5.x's fused layout, optional gated shared expert). It
implements the ``CausalLM`` protocol, so training, checkpoints, distillation, eval and
``moebit.inference.generate`` drive it as they drive moebit's GPT; decoding writes the same
preallocated ``KVCache`` (holding the key/value heads only, GQA's memory saving).

The auxiliary loss is transformers' (``load_balancing_loss_func``): one Switch loss over
the router logits of all MoE layers together, times ``router_aux_loss_coef``, so
``loss + aux_loss`` is the loss transformers trains with ``output_router_logits=True``.

    model = HFDecoder(HFDecoderConfig.from_hf(json.load(open("config.json"))))
    out = model(ids_BT, targets_BT)   # out.logits, out.loss, out.aux_loss, out.router_logits
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebit.models.hf.config import HFDecoderConfig
from moebit.models.hf.mla import MLAttention, latent_cache
from moebit.models.hf.norm import RMSNorm
from moebit.models.hf.sinks import windowed_attention
from moebit.models.interface import ModelOutput, keep_columns, keeps_all
from moebit.models.kv_cache import KVCache, kv_dtype
from moebit.models.rope import RotaryEmbedding
from moebit.moe import GatedMLP, MoE, MoEConfig, expert_parallel_groups, is_expert_param


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos``-width dimensions of each head (all of them unless the
    family's RoPE is partial); the rest pass through, as transformers' GLM/MiniMax do."""
    cos, sin = cos_BTd[:, None].to(x_BHTd.dtype), sin_BTd[:, None].to(x_BHTd.dtype)
    r = cos.shape[-1]
    if r == x_BHTd.shape[-1]:
        return x_BHTd * cos + _rotate_half(x_BHTd) * sin
    rot, rest = x_BHTd[..., :r], x_BHTd[..., r:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


class Attention(nn.Module):
    """GQA self-attention; with a ``KVCache`` over every key/value head cached so far."""

    def __init__(self, cfg: HFDecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        h, kv, dh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(d, h * dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, kv * dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, kv * dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * dh, d, bias=cfg.o_proj_bias)
        # gpt-oss: a sink logit per head, and a window on its "sliding_attention" layers
        self.sinks = nn.Parameter(torch.empty(h)) if cfg.attention_sinks else None
        sliding = bool(cfg.layer_types) and cfg.layer_types[layer] == "sliding_attention"
        self.window = cfg.sliding_window if sliding else None
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm != "none":
            q_dim, k_dim = (dh, dh) if cfg.qk_norm == "head" else (h * dh, kv * dh)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps)

    def _qkv(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        b, t, _ = x_BTD.shape
        q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if c.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        if c.clip_qkv is not None:
            q, k, v = (z.clamp(-c.clip_qkv, c.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, c.num_heads, c.head_dim)
        k = k.view(b, t, c.num_kv_heads, c.head_dim)
        v = v.view(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm == "head":  # Qwen3: per head
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q, k, v = self._qkv(x_BTD)
        q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        gqa = self.cfg.num_kv_heads != self.cfg.num_heads
        if self.sinks is not None or self.window is not None:
            drop = self.cfg.attention_dropout if self.training and cache is None else 0.0
            y = windowed_attention(q, k, v, self.sinks, self.window, cache, self.layer, drop)
        elif cache is None:
            drop = self.cfg.attention_dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop,
                                               enable_gqa=gqa)
        else:
            y = cache.attend(self.layer, q, k, v)
        # heads x head_dim named, not inferred: an expert-parallel rank with no prompt of its
        # own runs a zero-row batch, and -1 is ambiguous for 0 elements
        c = self.cfg
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))


@dataclass
class HFFeedForwardOutput:
    hidden: torch.Tensor
    aux_loss: torch.Tensor  # 0 here: the model computes transformers' loss over all layers
    router_logits: torch.Tensor | None  # [S, E] float32 (MoE layers only)
    stats: Any = None  # moebit RoutingStats (router metrics)


def moe_config_for(cfg: HFDecoderConfig) -> MoEConfig:
    """The moebit MoE block of these families: dropless top-k, SwiGLU experts.

    Renormalised softmax top-k (Mixtral; Qwen/OLMoE with norm_topk_prob) is a softmax over
    the k chosen logits (``softmax_before_topk=False``), which is exact at any k, k = 1
    included. GLM-4.5 MoE and MiniMax-M2 score with sigmoids, pick with the checkpoint's
    ``e_score_correction_bias`` added (and GLM within its best groups), and weigh by the
    plain sigmoid scores, renormalised, times ``routed_scaling_factor``.
    """
    sigmoid = cfg.scoring_func == "sigmoid"
    return MoEConfig(
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        drop_tokens=False, norm_topk_prob=cfg.norm_topk_prob,
        softmax_before_topk=sigmoid or not cfg.norm_topk_prob, router_aux_loss_coef=0.0,
        ep_size=cfg.ep_size, d_ffn=cfg.moe_intermediate_size, expert_type="swiglu",
        expert_bias=cfg.expert_bias, router_bias=cfg.router_bias, swiglu_alpha=cfg.swiglu_alpha,
        swiglu_limit=cfg.swiglu_limit, swiglu_up_shift=cfg.swiglu_up_shift,
        num_shared_experts=1 if cfg.shared_expert_intermediate_size else 0,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        shared_expert_gate=cfg.shared_expert_gated,
        scoring_func=cfg.scoring_func, score_correction_bias=cfg.score_correction_bias,
        n_group=cfg.n_group, topk_group=cfg.topk_group, group_score=cfg.group_score,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HFDecoderConfig, layer: int, ep_groups: Any = None) -> None:
        super().__init__()
        self.post_norm = cfg.post_norm  # OLMo2/FlexOlmo: norms on the sublayers' outputs
        if not self.post_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (MLAttention if cfg.is_mla else Attention)(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.post_norm:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = layer in cfg.moe_layers
        self.mlp: nn.Module = (MoE(cfg.hidden_size, moe_config_for(cfg), ep_groups) if self.is_moe
                               else GatedMLP(cfg.hidden_size, cfg.intermediate_size, "swiglu"))

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache | None = None) -> tuple[torch.Tensor, HFFeedForwardOutput | None]:
        """(new x, the feed-forward's output); decoding runs ``infer`` on the cache's rows."""
        if self.post_norm:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos_sin, cache))
            h = x
        else:
            x = x + self.self_attn(self.input_layernorm(x), cos_sin, cache)
            h = self.post_attention_layernorm(x)
        if cache is not None:
            return x + self._ffn_out(self._decode_ffn(h, cache.ffn_rows(x.shape[1]))), None
        if not self.is_moe:
            zero = h.new_zeros((), dtype=torch.float32)
            return x + self._ffn_out(self.mlp(h)), HFFeedForwardOutput(h, zero, None)
        out = self.mlp(h)
        router = self.mlp.gate.router
        with torch.autocast(h.device.type, enabled=False):
            logits_SE = F.linear(h.reshape(-1, h.shape[-1]).float(), router.weight.float(),
                                 None if router.bias is None else router.bias.float())
        return (x + self._ffn_out(out.hidden),
                HFFeedForwardOutput(out.hidden, out.aux_loss, logits_SE, out.stats))

    def _ffn_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(y) if self.post_norm else y

    def _decode_ffn(self, h_BTD: torch.Tensor, rows_N: torch.Tensor | None) -> torch.Tensor:
        b, t, d = h_BTD.shape
        run = self.mlp.infer if self.is_moe else self.mlp
        h_SD = h_BTD.reshape(b * t, d)
        if rows_N is None:
            return run(h_SD).view(b, t, d).to(h_BTD.dtype)
        out_ND = run(h_SD.index_select(0, rows_N)).to(h_BTD.dtype)
        return torch.zeros_like(h_SD).index_add(0, rows_N, out_ND).view(b, t, d)


def hf_load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int,
                           k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (no attention mask): E * sum_e f_e * P_e,
    f_e the top-k choices of e per token and P_e the mean probability, over all layers."""
    logits_SE = torch.cat(list(router_logits), 0)
    if logits_SE.shape[0] == 0:  # a rank with no token: no imbalance (not 0/0 = NaN)
        return logits_SE.new_zeros(())
    probs_SE = torch.softmax(logits_SE, dim=-1)
    top_SK = torch.topk(probs_SE, k, dim=-1).indices
    f_E = torch.bincount(top_SK.reshape(-1), minlength=num_experts).float() / logits_SE.shape[0]
    return num_experts * torch.dot(f_E, probs_SE.mean(0))


class HFDecoder(nn.Module):
    """A causal LM of one of the supported families, configured by ``HFDecoderConfig``."""

    # a one-token decode forward in place of the modules (``moebit.inference.fused_decode``
    # sets it): called with (ids, cache, logits_to_keep), it returns None for a call it
    # does not serve, and the modules run that one
    decode_step: Any = None

    def __init__(self, cfg: HFDecoderConfig, ep_groups: Any = None) -> None:
        """``ep_groups``: the expert-parallel groups when ``cfg.ep_size > 1`` (made here,
        collectively, when not given)."""
        super().__init__()
        self.config = cfg
        self.ep_groups = None
        if cfg.is_moe and cfg.ep_size > 1:
            self.ep_groups = ep_groups or expert_parallel_groups(cfg.ep_size)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(DecoderLayer(cfg, i, self.ep_groups) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
        self.rotary_emb = RotaryEmbedding(cfg.rope)
        std = float(cfg.hf.get("initializer_range", 0.02))
        for name, p in self.named_parameters():
            if p.dim() >= 2 and not is_expert_param(p):
                nn.init.normal_(p, std=std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(".sinks"):
                nn.init.normal_(p, std=std)

    @property
    def supports_ragged(self) -> bool:
        """Whether every layer's attention goes through ``cache.attend`` (the serving
        engine's packed ragged step). gpt-oss's sinks and windows and DeepSeek's latent
        cache read the cache themselves: the engine serves those with its two-forward step."""
        c = self.config
        return not (c.attention_sinks or c.sliding_window is not None or c.kv_lora_rank)

    def _cos_sin(self, pos_BT: torch.Tensor,
                 seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(pos_BT, seq_len)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None, logits_to_keep: int | torch.Tensor = 0) -> ModelOutput:
        """As ``GPT.forward``: logits, loss (targets), transformers' aux loss and each MoE
        layer's output (``router_logits`` on each; none while decoding with a cache)."""
        if cache is not None and self.decode_step is not None:
            out = self.decode_step(input_ids, cache, logits_to_keep)
            if out is not None:
                return out
        b, t = input_ids.shape
        if cache is None:
            pos = torch.arange(t, device=input_ids.device)[None].expand(b, t)
            cos_sin = self._cos_sin(pos, seq_len=t)
        else:  # unclamped, as transformers: dynamic NTK rescales past max_position_embeddings
            cos_sin = self._cos_sin(cache.positions(t))
        x = self.wte(input_ids)
        outs: list[HFFeedForwardOutput] = []
        for block in self.blocks:
            x, o = block(x, cos_sin, cache)
            if o is not None and o.router_logits is not None:
                outs.append(o)
        if cache is not None:
            cache.advance(t)
        aux = torch.zeros((), device=input_ids.device, dtype=torch.float32)
        if outs and self.config.router_aux_loss_coef:
            aux = self.config.router_aux_loss_coef * hf_load_balancing_loss(
                [o.router_logits for o in outs], self.config.num_experts,
                self.config.num_experts_per_tok)
        x = keep_columns(x, logits_to_keep)
        logits = self.lm_head(self.norm(x))
        loss = None
        if targets is not None:
            if not keeps_all(logits_to_keep):
                raise ValueError("targets need every column's logits: leave logits_to_keep at 0")
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return ModelOutput(logits, loss, aux, outs)

    def new_cache(self, batch: int, max_len: int, starts: Sequence[int] | None = None) -> KVCache:
        c, p = self.config, self.wte.weight
        if c.is_mla:  # the compressed latent, not per-head keys and values
            return latent_cache(c, batch, max_len, starts, p.dtype, p.device)
        return KVCache.allocate(c.num_layers, batch, c.num_kv_heads, c.head_dim, max_len,
                                starts, kv_dtype(self, p.dtype), p.device)

    def num_params(self) -> int:
        """Parameters of the whole model, counted once (a tied embedding is one tensor);
        with expert parallelism the experts of every rank are counted."""
        scale = self.ep_groups.ep_size if self.ep_groups is not None else 1
        return sum(p.numel() * (scale if is_expert_param(p) else 1) for p in self.parameters())

    def num_expert_params(self) -> int:
        scale = self.ep_groups.ep_size if self.ep_groups is not None else 1
        return scale * sum(p.numel() for p in self.parameters() if is_expert_param(p))
