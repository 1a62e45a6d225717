"""A toy model family, registered from the tests: its own config type, model class and
folder format (config.json + model.safetensors), built from moebit's blocks. Importing
this module registers it (in every process that imports it: spawned ranks import the
test module, and so this one)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from moebit.comm import collectives
from moebit.models.family import Fits, LayerPattern
from moebit.models.gpt import Block, GPTConfig
from moebit.models.interface import ModelOutput
from moebit.models.kv_cache import KVCache
from moebit.models.registry import register
from moebit.models.tokenizer import ByteTokenizer, Tokenizer
from moebit.models.upcycling import UpcycleSpec, warn_unless_dense
from moebit.moe import MoEConfig, expert_parallel_groups, is_expert_param

TYPE = "toy_lm"


@dataclasses.dataclass
class ToyConfig:
    n_layer: int = 4
    d_model: int = 32
    n_head: int = 2
    max_position_embeddings: int = 64  # the position table (a shape)
    block_size: int = 64  # the sequence length a run trains and decodes at (<= the table)
    num_experts: int = 0  # on every moe_every-th layer
    moe_every: int = 2
    num_experts_per_tok: int = 2
    ep_size: int = 1
    model_type: str = TYPE
    vocab_size: int = 256

    def gpt(self) -> GPTConfig:
        """The blocks' settings (moebit's GPT blocks: attention + MLP or MoE)."""
        moe = ({"num_experts_per_tok": self.num_experts_per_tok, "norm_topk_prob": True,
                "drop_tokens": False, "ep_size": self.ep_size} if self.num_experts else None)
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size,
                         n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model,
                         num_experts=self.num_experts, moe_every=self.moe_every, moe=moe)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ToyLM(nn.Module):
    """Token and position embeddings, moebit blocks, a final norm and an untied head."""

    def __init__(self, cfg: ToyConfig, ep_groups: Any = None) -> None:
        super().__init__()
        self.config = cfg
        g = cfg.gpt()
        self.ep_groups = None
        if cfg.num_experts and cfg.ep_size > 1:
            self.ep_groups = ep_groups or expert_parallel_groups(cfg.ep_size)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_position_embeddings, cfg.d_model)
        self.blocks = nn.ModuleList(Block(g, i, self.ep_groups) for i in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                cache: Any = None, logits_to_keep: int = 0) -> ModelOutput:
        b, t = input_ids.shape
        pos = (cache.positions(t) if cache is not None
               else torch.arange(t, device=input_ids.device)[None].expand(b, t))
        x = self.tok(input_ids) + self.pos(pos.clamp(max=self.config.max_position_embeddings - 1))
        outs = []
        for block in self.blocks:
            x, o = block(x, cache)
            if o is not None:
                outs.append(o)
        if cache is not None:
            cache.advance(t)
        aux = sum((o.aux_loss for o in outs), torch.zeros((), device=x.device))
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return ModelOutput(logits, loss, aux, outs)

    def new_cache(self, batch: int, max_len: int, starts: Any = None) -> KVCache:
        c, p = self.config, self.head.weight
        return KVCache.allocate(c.n_layer, batch, c.n_head, c.d_model // c.n_head, max_len,
                                starts, p.dtype, p.device)

    def num_params(self) -> int:
        scale = self.config.ep_size if self.ep_groups is not None else 1
        return sum(p.numel() * (scale if is_expert_param(p) else 1) for p in self.parameters())

    def num_expert_params(self) -> int:
        scale = self.config.ep_size if self.ep_groups is not None else 1
        return scale * sum(p.numel() for p in self.parameters() if is_expert_param(p))


def _is_moe(cfg: ToyConfig, n: int) -> list[bool]:
    return [bool(cfg.num_experts) and (i + 1) % cfg.moe_every == 0 for i in range(n)]


@dataclasses.dataclass(frozen=True)
class ToyFamily:
    name: str = TYPE

    def owns(self, cfg: Any) -> bool:
        return isinstance(cfg, ToyConfig)

    def owns_dict(self, d: dict[str, Any]) -> bool:
        return d.get("model_type") == TYPE

    def owns_folder(self, path: Path) -> bool:
        f = Path(path) / "config.json"
        if not (f.is_file() and (Path(path) / "model.safetensors").is_file()):
            return False
        try:
            return json.loads(f.read_text()).get("model_type") == TYPE
        except (OSError, ValueError):
            return False

    def config_from_dict(self, d: dict[str, Any]) -> ToyConfig:
        return ToyConfig(**d)

    def read_folder_config(self, path: Path, ep_size: int = 1) -> ToyConfig:
        cfg = ToyConfig(**json.loads((Path(path) / "config.json").read_text()))
        return self.with_ep_size(cfg, ep_size)

    def pattern(self, cfg: ToyConfig) -> LayerPattern:
        moe = _is_moe(cfg, cfg.n_layer)
        return LayerPattern(cfg.n_layer, tuple(cfg.num_experts if m else 0 for m in moe), cfg.ep_size)

    def with_ep_size(self, cfg: ToyConfig, ep_size: int) -> ToyConfig:
        return dataclasses.replace(cfg, ep_size=ep_size if cfg.num_experts else 1)

    def moe(self, cfg: ToyConfig) -> MoEConfig | None:
        return cfg.gpt().moe  # type: ignore[return-value]

    def check(self, cfg: ToyConfig) -> None:
        pass

    def build(self, cfg: ToyConfig, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None) -> ToyLM:
        if str(device) == "meta":
            groups = expert_parallel_groups(cfg.ep_size) if cfg.num_experts and cfg.ep_size > 1 else None
            with torch.device("meta"):
                return ToyLM(cfg, groups)
        model = ToyLM(cfg).to(device)
        return model.to(dtype) if dtype is not None else model

    def load_folder(self, cfg: ToyConfig, path: Path, dtype: torch.dtype | None = None) -> ToyLM:
        model = self.build(cfg, dtype=dtype)
        state = load_file(str(Path(path) / "model.safetensors"))
        mine = model.state_dict()
        if cfg.ep_size > 1:  # this rank's slice of each stacked expert tensor
            r = collectives.rank() % cfg.ep_size
            for k, v in mine.items():
                if v.shape != state[k].shape:
                    n = v.shape[0]
                    state[k] = state[k][r * n:(r + 1) * n]
        model.load_state_dict(state)
        return model

    def save_folder(self, model: Any, out: Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if model.ep_groups is not None:
            raise ValueError("the toy family saves one-process models only")
        (out / "config.json").write_text(json.dumps(model.config.to_dict()))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(out / "model.safetensors"))
        return out

    def stored_dtype(self, cfg: ToyConfig) -> torch.dtype | None:
        return None

    def upcycle_folder(self, src: Path, out: Path, spec: UpcycleSpec) -> str:
        dense_cfg = self.read_folder_config(src)
        if dense_cfg.num_experts:
            raise ValueError("upcycle: the toy model is already MoE")
        moe_cfg = dataclasses.replace(dense_cfg, num_experts=spec.num_experts,
                                      moe_every=spec.moe_every,
                                      num_experts_per_tok=spec.num_experts_per_tok)
        dense = self.load_folder(dense_cfg, src).state_dict()
        moe = self.build(moe_cfg)
        target = moe.state_dict()
        copier = spec.copier()
        state = {k: v for k, v in dense.items() if k in target and v.shape == target[k].shape}
        for layer in self.pattern(moe_cfg).moe_layers:
            p = f"blocks.{layer}.ffn."
            for name, (src_name, transpose) in {"w1": ("fc.weight", True), "b1": ("fc.bias", False),
                                                "w2": ("proj.weight", True),
                                                "b2": ("proj.bias", False)}.items():
                w = dense.pop(p + src_name)
                state[p + "experts." + name] = copier.experts(w.t() if transpose else w,
                                                              spec.num_experts, noisy=transpose)
            state[p + "gate.router.weight"] = copier.router(
                tuple(target[p + "gate.router.weight"].shape), torch.float32)
        warn_unless_dense(True, spec.noise_std)  # renormalised top-k: the weights sum to 1
        moe.load_state_dict(state)
        self.save_folder(moe, out)
        return TYPE

    def tokenizer(self, source: Path | None) -> Tokenizer:
        return ByteTokenizer()

    def student_fits(self, cfg: ToyConfig, n_student: int) -> Fits:
        t, s = _is_moe(cfg, cfg.n_layer), _is_moe(cfg, n_student)
        return lambda i, j: t[j] == s[i]

    def misfit(self, cfg: ToyConfig, keep: list[int], i: int, k: int) -> str:
        return f"--keep-layers {keep}: toy layer {i} and teacher layer {k} differ in kind"

    def max_student_layers(self, cfg: ToyConfig) -> int:
        return cfg.n_layer - 1

    def student_config(self, cfg: ToyConfig, keep: list[int]) -> ToyConfig:
        return dataclasses.replace(cfg, n_layer=len(keep))

    def student_shape(self, cfg: ToyConfig) -> dict[str, Any]:
        return {k: v for k, v in cfg.to_dict().items() if k not in ("n_layer", "ep_size")}


TOY = register(ToyFamily())
