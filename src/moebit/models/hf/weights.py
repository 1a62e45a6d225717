"""Hugging Face safetensors checkpoints <-> ``HFDecoder`` parameters.

Reading goes through ``safetensors.safe_open`` (memory-mapped, no pickle), one tensor at a
time straight into the model's parameter, so peak memory is the model plus one tensor.
Both expert layouts load:

- transformers 5.x fused: ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
  ``mlp.experts.down_proj`` [E, H, I]: moebit's own layout, sliced to the local experts
  (``get_slice``: a rank reads only its rows);
- transformers 4.x per expert (what 5.x's ``save_pretrained`` still writes):
  ``experts.N.gate_proj/up_proj/down_proj.weight`` (Qwen, OLMoE, GLM) or, under Mixtral's
  and MiniMax-M2's ``block_sparse_moe``, ``experts.N.w1/w3/w2.weight``: a rank opens only
  its experts'.

GLM-4.5 MoE and MiniMax-M2 also carry each MoE layer's fixed selection bias
(``e_score_correction_bias``, a buffer of the gate), read and written with the router.

Writing produces the per-expert layout (which transformers 4.x and 5.x both load), as
sharded safetensors with ``model.safetensors.index.json``: one shard of the non-expert
tensors and one per expert-parallel rank, each written by the rank holding those experts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moebit.models.hf import gpt_oss_weights

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# per-expert names: (gate, up, down) of the 4.x layout
_PER_EXPERT = {"mixtral": ("w1", "w3", "w2"), "minimax_m2": ("w1", "w3", "w2")}
_DEFAULT_PER_EXPERT = ("gate_proj", "up_proj", "down_proj")
# families whose MoE block transformers writes as ``block_sparse_moe`` (it reads both)
_BLOCK_SPARSE = ("mixtral", "minimax_m2")
# where the fixed selection bias sits: under the router (GLM) or beside it (MiniMax-M2)
_BIAS_UNDER_GATE = ("glm4_moe", "deepseek_v3")
# families whose plain shared experts transformers calls ``shared_experts``
_SHARED_EXPERTS = ("glm4_moe", "deepseek_v3", "deepseek_v2")
BIAS = "e_score_correction_bias"


class HFFolderError(ValueError):
    """A Hugging Face folder that does not load; the message names the file and the problem
    (a ValueError, so every command reports it as one line with exit code 2)."""


class MissingTensorError(HFFolderError, KeyError):
    """A tensor the config implies is not in the checkpoint (also a KeyError, as it was)."""

    __str__ = BaseException.__str__  # KeyError's would quote the message


@dataclass
class LoadReport:
    """What a load read: tests check that an expert-parallel rank read only its experts."""

    tensors_read: list[str] = field(default_factory=list)
    files_opened: list[str] = field(default_factory=list)


class SafetensorsFolder:
    """The tensors of a checkpoint folder, opened lazily file by file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.report = LoadReport()
        self._handles: dict[str, Any] = {}
        if (folder / INDEX).is_file():
            self.where: dict[str, str] = _weight_map(folder / INDEX)
        elif (folder / SINGLE).is_file():
            self.where = {k: SINGLE for k in self._open(SINGLE).keys()}
        else:
            raise HFFolderError(f"{folder} holds neither {SINGLE} nor {INDEX}: no weights")

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            path = self.folder / file
            if not path.is_file():
                raise HFFolderError(f"{path} (listed in {INDEX}) does not exist")
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors' own error type: truncated, not safetensors
                raise HFFolderError(f"{path}: not a readable safetensors file ({e})") from None
            self.report.files_opened.append(file)
        return self._handles[file]

    def files(self) -> list[str]:
        """Every weight file the folder lists."""
        return sorted(set(self.where.values()))

    def shape(self, name: str, rows: slice | None = None) -> tuple[int, ...]:
        """A tensor's shape from its file's header (no data read), rows sliced as ``read``."""
        shape = list(self._open(self.where[name]).get_slice(name).get_shape())
        if rows is not None:
            shape[0] = len(range(shape[0])[rows])
        return tuple(shape)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        h = self._open(self.where[name])
        self.report.tensors_read.append(name)
        return h.get_slice(name)[rows] if rows is not None else h.get_tensor(name)


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``, checked."""
    try:
        wm = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise HFFolderError(f"{index} is not a valid index JSON object ({e})") from None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise HFFolderError(f"{index} has no weight_map of tensor name -> file")
    return dict(wm)


def hf_name(name: str, model_type: str = "") -> str:
    """The transformers name of a non-expert ``HFDecoder`` parameter (GLM-4.5 MoE calls
    its shared expert ``shared_experts``)."""
    if name == "wte.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return name
    if not name.startswith("blocks."):
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    layer, sub = name[len("blocks."):].split(".", 1)
    if model_type == "gpt_oss":  # GptOssTopKRouter: mlp.router.weight / .bias
        sub = sub.replace("mlp.gate.router.", "mlp.router.")
    sub = sub.replace("mlp.gate.router.", "mlp.gate.")
    if model_type in _SHARED_EXPERTS:
        sub = sub.replace("mlp.shared_expert.", "mlp.shared_experts.")
    return f"model.layers.{layer}.{sub}"


def bias_names(model_type: str, layer: int) -> list[str]:
    """The names a layer's ``e_score_correction_bias`` may have, the one written first."""
    if model_type in _BIAS_UNDER_GATE:
        return [f"model.layers.{layer}.mlp.gate.{BIAS}"]
    mods = ("block_sparse_moe", "mlp") if model_type in _BLOCK_SPARSE else ("mlp",)
    return [f"model.layers.{layer}.{m}.{BIAS}" for m in mods]


def _gate_bias(model: Any, layer: int) -> torch.Tensor | None:
    return getattr(model.blocks[layer].mlp.gate, BIAS, None)


def _missing(src: SafetensorsFolder, name: str, why: str = "") -> MissingTensorError:
    where = INDEX if (src.folder / INDEX).is_file() else SINGLE
    return MissingTensorError(f"{src.folder / where}: no tensor {name}{why}")


def _moe_prefix(src: SafetensorsFolder, layer: int) -> str:
    """``model.layers.i.mlp`` or Mixtral 4.x's ``model.layers.i.block_sparse_moe``."""
    for p in (f"model.layers.{layer}.mlp", f"model.layers.{layer}.block_sparse_moe"):
        if f"{p}.gate.weight" in src:
            return p
    raise _missing(src, f"model.layers.{layer}.mlp.gate.weight",
                   f" (the router: config.json makes layer {layer} an MoE layer)")


# (transformers name, rows of it this rank reads or None, the model tensor it fills)
Target = tuple[str, slice | None, torch.Tensor]


def _expert_targets(model: Any, src: SafetensorsFolder, layer: int) -> Iterator[Target]:
    experts = model.blocks[layer].mlp.experts
    lo, hi = experts.first_expert, experts.first_expert + experts.num_local
    p = _moe_prefix(src, layer)
    if f"{p}.experts.gate_up_proj" in src:  # 5.x fused: slice this rank's experts
        for n in ("gate_up_proj", "down_proj"):
            full = f"{p}.experts.{n}"
            if full not in src:
                raise _missing(src, full)
            yield full, slice(lo, hi), getattr(experts, n)
        return
    g_n, u_n, d_n = _PER_EXPERT.get(model.config.model_type, _DEFAULT_PER_EXPERT)
    f = experts.d_ffn
    for e in range(lo, hi):
        names = [f"{p}.experts.{e}.{n}.weight" for n in (g_n, u_n, d_n)]
        for n in names:
            if n not in src:
                raise _missing(src, n)
        gate_up = experts.gate_up_proj[e - lo]
        yield names[0], None, gate_up[:f]
        yield names[1], None, gate_up[f:]
        yield names[2], None, experts.down_proj[e - lo]


def _bias_targets(model: Any, src: SafetensorsFolder) -> Iterator[Target]:
    """Each MoE layer's fixed selection bias (GLM-4.5 MoE, MiniMax-M2), by either name."""
    for layer in model.config.moe_layers:
        bias = _gate_bias(model, layer)
        if bias is None:
            continue
        names = bias_names(model.config.model_type, layer)
        found = [n for n in names if n in src]
        if not found:
            raise _missing(src, names[-1], " (the router's e_score_correction_bias)")
        yield found[0], None, bias


def _targets(model: Any, src: SafetensorsFolder) -> Iterator[Target]:
    """Every tensor a load reads, in load order; a missing one is a named error before any
    later tensor is read. Shared by the load and the check, so they cannot disagree."""
    mt = model.config.model_type
    for name, p in model.named_parameters():  # a tied lm_head is listed once, as wte
        if ".mlp.experts." in name:
            continue
        hn = hf_name(name, mt)
        if hn not in src and ".mlp." in hn:
            hn = hn.replace(".mlp.", ".block_sparse_moe.")
        if hn not in src:
            raise _missing(src, hf_name(name, mt))
        yield hn, None, p
    yield from _bias_targets(model, src)
    if mt == "gpt_oss":  # fused, transposed, maybe MXFP4: _gpt_oss_reads
        return
    for layer in model.config.moe_layers:
        yield from _expert_targets(model, src, layer)


def _gpt_oss_reads(model: Any, src: SafetensorsFolder) -> Iterator[gpt_oss_weights.Read]:
    """gpt-oss's expert tensors (``gpt_oss_weights``), each checked to be in the folder."""
    if model.config.model_type != "gpt_oss":
        return
    for layer in model.config.moe_layers:
        for r in gpt_oss_weights.expert_reads(model, layer, src.__contains__):
            for name in r.names:
                if name not in src:
                    raise _missing(src, name)
            yield r


def _check_read_shape(src: SafetensorsFolder, name: str, got: tuple[int, ...],
                      want: tuple[int, ...], rows: slice) -> None:
    if got != want:
        raise HFFolderError(f"{src.folder / src.where[name]}: tensor {_label(name, rows)} has "
                            f"shape {got}, config.json implies {want}")


def _label(name: str, rows: slice | None) -> str:
    return name if rows is None else f"{name}[{rows.start}:{rows.stop}]"


def _check_shape(src: SafetensorsFolder, name: str, got: tuple[int, ...],
                 dst: torch.Tensor, rows: slice | None) -> None:
    if got != tuple(dst.shape):
        raise HFFolderError(f"{src.folder / src.where[name]}: tensor {_label(name, rows)} has "
                            f"shape {got}, config.json implies {tuple(dst.shape)}")


def load_hf_weights(model: Any, folder: str | Path) -> LoadReport:
    """Copy a safetensors checkpoint into ``model`` (an ``HFDecoder``); missing tensors and
    shape mismatches raise naming the tensor. Returns what was read."""
    src = SafetensorsFolder(Path(folder))
    for name, rows, dst in _targets(model, src):
        t = src.read(name, rows)
        _check_shape(src, name, tuple(t.shape), dst, rows)
        with torch.no_grad():
            dst.copy_(t)
    for r in _gpt_oss_reads(model, src):
        ts = [src.read(name, r.rows) for name in r.names]
        for name, t, want in zip(r.names, ts, r.shapes, strict=True):
            _check_read_shape(src, name, tuple(t.shape), want, r.rows)
        r.assign(ts)
    return src.report


def check_hf_weights(model: Any, folder: str | Path) -> None:
    """What ``load_hf_weights`` would raise, from the files' headers only (no tensor data
    is read; ``model`` may live on the meta device): every listed file opens as
    safetensors, and every tensor the model needs is there with the model's shape."""
    src = SafetensorsFolder(Path(folder))
    for file in src.files():
        src._open(file)
    for name, rows, dst in _targets(model, src):
        _check_shape(src, name, src.shape(name, rows), dst, rows)
    for r in _gpt_oss_reads(model, src):
        for name, want in zip(r.names, r.shapes, strict=True):
            _check_read_shape(src, name, src.shape(name, r.rows), want, r.rows)


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def expert_tensors(model: Any) -> dict[str, torch.Tensor]:
    """This rank's experts in the per-expert (4.x) layout, by transformers name."""
    cfg = model.config
    mixtral = cfg.model_type in _BLOCK_SPARSE
    g_n, u_n, d_n = _PER_EXPERT.get(cfg.model_type, _DEFAULT_PER_EXPERT)
    out: dict[str, torch.Tensor] = {}
    for layer in cfg.moe_layers:
        ex = model.blocks[layer].mlp.experts
        p = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.experts"
        f = ex.d_ffn
        for j in range(ex.num_local):
            e = ex.first_expert + j
            out[f"{p}.{e}.{g_n}.weight"] = ex.gate_up_proj[j, :f].detach().contiguous()
            out[f"{p}.{e}.{u_n}.weight"] = ex.gate_up_proj[j, f:].detach().contiguous()
            out[f"{p}.{e}.{d_n}.weight"] = ex.down_proj[j].detach().contiguous()
    return out


def dense_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Every non-expert tensor by transformers name (a tied lm_head is not written), the
    fixed selection biases included."""
    mt = model.config.model_type
    mixtral = mt in _BLOCK_SPARSE
    out = {}
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            continue
        hn = hf_name(name, mt)
        if mixtral and ".mlp.gate." in hn:
            hn = hn.replace(".mlp.", ".block_sparse_moe.")
        out[hn] = p.detach().contiguous().clone()
    for layer in model.config.moe_layers:
        bias = _gate_bias(model, layer)
        if bias is not None:
            out[bias_names(mt, layer)[0]] = bias.detach().contiguous().clone()
    return out


def write_shards(model: Any, folder: Path, ep_rank: int, write_dense: bool) -> None:
    """This rank's part of a sharded checkpoint: its expert shard (when it holds experts
    no lower data-parallel rank also holds) and, on rank 0, the dense shard and the index."""
    cfg = model.config
    if cfg.model_type == "gpt_oss":
        _write_gpt_oss(model, folder, write_dense)
        return
    ep = cfg.ep_size if cfg.is_moe else 1
    n = 1 + (ep if cfg.is_moe else 0)
    meta = {"format": "pt"}
    if cfg.is_moe:
        save_file(expert_tensors(model), str(folder / _shard_name(2 + ep_rank, n)), metadata=meta)
    if not write_dense:
        return
    dense = dense_tensors(model)
    save_file(dense, str(folder / _shard_name(1, n)), metadata=meta)
    weight_map = dict.fromkeys(dense, _shard_name(1, n))
    for r in range(ep):
        for name in _expert_names(model, r):
            weight_map[name] = _shard_name(2 + r, n)
    total = sum(t.numel() * t.element_size() for t in dense.values())
    expert_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                       if getattr(p, "moebit_expert", False)) * ep
    index = {"metadata": {"total_size": total + expert_bytes}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _expert_names(model: Any, ep_rank: int) -> list[str]:
    cfg = model.config
    g_n, u_n, d_n = _PER_EXPERT.get(cfg.model_type, _DEFAULT_PER_EXPERT)
    mod = "block_sparse_moe" if cfg.model_type in _BLOCK_SPARSE else "mlp"
    per = cfg.num_experts // cfg.ep_size
    return [f"model.layers.{layer}.{mod}.experts.{e}.{n}.weight"
            for layer in cfg.moe_layers for e in range(ep_rank * per, (ep_rank + 1) * per)
            for n in (g_n, u_n, d_n)]


def _write_gpt_oss(model: Any, folder: Path, write_dense: bool) -> None:
    """gpt-oss: each expert tensor is whole in its file (transformers' fused layout), so the
    expert-parallel ranks gather their experts (every caller takes part) and rank 0 writes a
    dense shard and an expert shard (dequantized: an MXFP4 source is written unquantized)."""
    experts = gpt_oss_weights.fused_expert_tensors(model)
    if not write_dense:
        return
    dense = dense_tensors(model)
    meta = {"format": "pt"}
    save_file(dense, str(folder / _shard_name(1, 2)), metadata=meta)
    save_file(experts, str(folder / _shard_name(2, 2)), metadata=meta)
    weight_map = {**dict.fromkeys(dense, _shard_name(1, 2)), **dict.fromkeys(experts, _shard_name(2, 2))}
    total = sum(t.numel() * t.element_size() for t in (*dense.values(), *experts.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
