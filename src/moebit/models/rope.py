"""Rotary position embeddings of the Hugging Face families, with transformers' scaling variants.

A checkpoint's RoPE is part of what its weights mean: the same weights under another
frequency schedule are another model. So the formulas here are transformers'
(``modeling_rope_utils``), step for step, in the same float32 operations, and the two
stateful variants behave as transformers' rotary module does call by call:

- "dynamic" (NTK) recomputes the frequencies when a forward reaches past the longest
  position seen so far beyond ``max_position_embeddings`` and goes back to the original
  ones on a forward shorter than ``max_position_embeddings``. While decoding with a KV
  cache only the new tokens get the new frequencies: keys already cached keep theirs.
- "longrope" uses its long factors on a forward whose last position lies beyond
  ``original_max_position_embeddings``, its short ones otherwise.

"yarn" and "longrope" also scale cos and sin by an attention factor.

Partial rotary (``partial_rotary_factor`` < 1: GLM-4.5 MoE, MiniMax-M2) rotates only the
first ``int(head_dim * factor)`` dimensions of each head: every schedule is computed over
that width (``RopeSpec.dim``) and cos/sin are that wide; the caller passes the rest through.

    spec = parse_rope(hf_config_json, head_dim=128, default_theta=1e6)
    rotary = RotaryEmbedding(spec)
    cos_BTd, sin_BTd = rotary(pos_BT)          # float32, attention factor applied
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# keys each type must have / may have besides rope_type (or 4.x "type") and rope_theta
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "default": (), "linear": (), "dynamic": (),
    "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
    "llama3": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "attention_factor", "factor"),
}
_COMMON = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


@dataclass(frozen=True)
class RopeSpec:
    """One model's RoPE: its type, base, factor and the type's other parameters, every
    default of transformers filled in (``params``), so nothing is decided at run time."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    head_dim: int = 64
    max_position_embeddings: int = 4096
    params: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # the share of head_dim that rotates

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if not 0 < self.partial_rotary_factor <= 1 or self.dim < 2 or self.dim % 2:
            raise ValueError(f"partial_rotary_factor = {self.partial_rotary_factor!r} of head_dim "
                             f"{self.head_dim} gives {self.dim} rotary dimensions: it must be in "
                             "(0, 1] and leave an even number >= 2")

    @property
    def dim(self) -> int:
        """The rotated width of a head (transformers' ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def original_max_position_embeddings(self) -> int:
        return int(self.params.get("original_max_position_embeddings",
                                   self.max_position_embeddings))


def _number(where: str, key: str, value: Any, low: float | None = None,
            strict: bool = False) -> float:
    """``value`` as a float, or an error naming ``where.key`` (bools are not numbers)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if strict else value >= low
    if not ok:
        bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
        raise ValueError(f"{where}.{key} must be a finite number{bound}, got {value!r}")
    return float(value)


def _source(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Where the RoPE parameters are: 4.x ``rope_scaling`` wins over 5.x ``rope_parameters``,
    as transformers reads them."""
    for key in ("rope_scaling", "rope_parameters"):
        d = hf.get(key)
        if d is None or d == {}:
            continue
        if not isinstance(d, dict):
            raise ValueError(f"{key} must be a JSON object, got {d!r}")
        return key, d
    return "rope_parameters", {}


def parse_rope(hf: dict[str, Any], head_dim: int, default_theta: float = 10000.0,
               default_partial: float = 1.0) -> RopeSpec:
    """The ``RopeSpec`` of a config.json. An unknown key, a missing required one or a
    malformed value (what transformers' validation calls invalid) is an error naming it.

    ``partial_rotary_factor``: the RoPE dict's, else the top-level key's (transformers'
    order), else ``default_partial`` (the family's default)."""
    where, src = _source(hf)
    rtype = src.get("rope_type", src.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise ValueError(f"{where}.rope_type {rtype!r} is not supported; supported: {ROPE_TYPES}")
    allowed = set(_COMMON) | set(_REQUIRED[rtype]) | set(_OPTIONAL[rtype])
    for key in src:
        if key not in allowed:
            raise ValueError(f"{where}: unknown key {key!r} for rope_type {rtype!r} "
                             f"(allowed: {sorted(allowed - {'type'})})")
    for key in _REQUIRED[rtype]:
        if src.get(key) is None:
            raise ValueError(f"{where}: rope_type {rtype!r} needs {key!r}")
    prf_src = src.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    prf = default_partial if prf_src is None else _number(where, "partial_rotary_factor",
                                                          prf_src, 0, True)
    dim = int(head_dim * prf)
    # a 4.x rope_scaling holds no theta: the top-level one (rope_parameters is not read
    # when rope_scaling is there, as in transformers)
    theta_src = src.get("rope_theta", hf.get("rope_theta"))
    theta = default_theta if theta_src is None else _number(where, "rope_theta", theta_src, 0, True)
    max_pos = int(hf.get("max_position_embeddings", 4096))
    factor = 1.0
    if src.get("factor") is not None:
        factor = _number(where, "factor", src["factor"], 1.0)
    params = _type_params(where, rtype, src, dim, max_pos)
    if rtype == "longrope" and src.get("factor") is None:
        factor = max_pos / params["original_max_position_embeddings"]
    if rtype in ("yarn", "longrope") and params.get("attention_factor") is None:
        params["attention_factor"] = _default_attention_factor(rtype, factor, params)
    return RopeSpec(rtype, theta, factor, head_dim, max_pos, params, prf)


def _type_params(where: str, rtype: str, src: dict[str, Any], head_dim: int,
                 max_pos: int) -> dict[str, Any]:
    """The type's parameters besides factor, checked, transformers' defaults filled in
    (``head_dim``: the rotated width)."""
    p: dict[str, Any] = {}
    if rtype in ("yarn", "llama3", "longrope"):
        orig = src.get("original_max_position_embeddings", max_pos)
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            raise ValueError(f"{where}.original_max_position_embeddings must be a positive "
                             f"integer, got {orig!r}")
        p["original_max_position_embeddings"] = orig
    if rtype in ("yarn", "longrope") and src.get("attention_factor") is not None:
        p["attention_factor"] = _number(where, "attention_factor", src["attention_factor"], 0, True)
    if rtype == "yarn":
        # transformers: `get("beta_fast") or 32`, so 0 and null also mean the default
        p["beta_fast"] = _number(where, "beta_fast", src.get("beta_fast") or 32)
        p["beta_slow"] = _number(where, "beta_slow", src.get("beta_slow") or 1)
        if p["beta_fast"] < p["beta_slow"]:
            raise ValueError(f"{where}.beta_fast ({p['beta_fast']:g}) must be >= "
                             f"beta_slow ({p['beta_slow']:g})")
        for key in ("mscale", "mscale_all_dim"):
            if src.get(key) is not None:
                p[key] = _number(where, key, src[key])
        truncate = src.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{where}.truncate must be true or false, got {truncate!r}")
        p["truncate"] = truncate
    if rtype == "llama3":
        low = _number(where, "low_freq_factor", src["low_freq_factor"])
        high = _number(where, "high_freq_factor", src["high_freq_factor"])
        if high <= low:
            raise ValueError(f"{where}.high_freq_factor ({high:g}) must be greater than "
                             f"low_freq_factor ({low:g})")
        p["low_freq_factor"], p["high_freq_factor"] = low, high
    if rtype == "longrope":
        for key in ("short_factor", "long_factor"):
            v = src[key]
            if (not isinstance(v, list) or len(v) != head_dim // 2
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
                raise ValueError(f"{where}.{key} must be a list of {head_dim // 2} numbers "
                                 f"(head_dim / 2), got {v!r}")
            p[key] = [float(x) for x in v]
    return p


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _default_attention_factor(rtype: str, factor: float, p: dict[str, Any]) -> float:
    """The cos/sin scale the papers suggest when the config gives none (transformers')."""
    if rtype == "yarn":
        if p.get("mscale") and p.get("mscale_all_dim"):
            return _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"])
        return _yarn_mscale(factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(p["original_max_position_embeddings"]))


def _exponents(dim: int, device: torch.device | None) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def rope_frequencies(spec: RopeSpec, seq_len: int | None = None,
                     device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32, attention scale of cos/sin).

    ``seq_len``: the last position + 1 of the forward, for the types that depend on it
    (dynamic, longrope); None at construction, as transformers initialises them."""
    dim, base, p = spec.dim, spec.theta, spec.params
    if spec.rope_type in ("default", "linear"):
        return 1.0 / (base ** _exponents(dim, device)) / spec.factor, 1.0
    if spec.rope_type == "dynamic":
        return _dynamic(spec, seq_len, device), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec, device), float(p["attention_factor"])
    if spec.rope_type == "llama3":
        return _llama3(spec, device), 1.0
    long = seq_len is not None and seq_len > spec.original_max_position_embeddings
    ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32,
                       device=device)
    return 1.0 / (ext * base ** _exponents(dim, device)), float(p["attention_factor"])


def _dynamic(spec: RopeSpec, seq_len: int | None, device: torch.device | None) -> torch.Tensor:
    """NTK: base * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2)), L >= max_pos.
    On a tensor L, as transformers computes it (float32), so the bits agree."""
    dim, max_pos = spec.dim, spec.max_position_embeddings
    s = torch.tensor(max(seq_len or max_pos, max_pos), dtype=torch.int64, device=device)
    base = spec.theta * ((spec.factor * s / max_pos) - (spec.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim, device))


def _yarn(spec: RopeSpec, device: torch.device | None) -> torch.Tensor:
    """YaRN: interpolate (divide by factor) the low frequencies, keep the high ones, and
    ramp linearly in between, over the dimensions set by beta_fast / beta_slow."""
    dim, base, p = spec.dim, spec.theta, spec.params
    orig = spec.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp.to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (spec.factor * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3(spec: RopeSpec, device: torch.device | None) -> torch.Tensor:
    """Llama 3.1: wavelengths above original / low_freq_factor are divided by factor,
    those below original / high_freq_factor kept, those between smoothly blended."""
    p, factor = spec.params, spec.factor
    inv = 1.0 / (spec.theta ** _exponents(spec.dim, device))
    orig = spec.original_max_position_embeddings
    low_f, high_f = p["low_freq_factor"], p["high_freq_factor"]
    low_wavelen, high_wavelen = orig / low_f, orig / high_f
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of positions under one ``RopeSpec``; holds dynamic NTK's state.

    The frequencies are float32 buffers recomputed on every ``.to()`` / ``to_empty()``
    (so a model built on the meta device, or cast to bfloat16, still rotates with exact
    float32 frequencies, as transformers keeps them)."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("original_inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("long_inv_freq", torch.empty(0), persistent=False)
        self.reset_frequencies()

    def reset_frequencies(self, device: torch.device | None = None) -> None:
        """The frequencies at construction (dynamic NTK's state forgotten)."""
        device = torch.device(device if device is not None else self.inv_freq.device)
        # On the meta device only the shapes matter: compute on the CPU (meta arithmetic
        # runs torch's Python references, which import torch._dynamo) and keep no values.
        at = torch.device("cpu") if device.type == "meta" else device
        with torch.device(at):  # also the tensors made without a device (under on_meta)
            inv, self.attention_scaling = rope_frequencies(self.spec, device=at)
            long = None
            if self.spec.rope_type == "longrope":
                seq = self.spec.original_max_position_embeddings + 1
                long = rope_frequencies(self.spec, seq, at)[0]
        inv = inv.to(device)
        self.inv_freq, self.original_inv_freq = inv, inv.clone()
        if long is not None:
            self.long_inv_freq = long.to(device)
        self.max_seq_len_cached = self.spec.max_position_embeddings

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        super()._apply(fn, recurse)
        self.reset_frequencies(self.inv_freq.device)
        return self

    def _dynamic_update(self, seq_len: int) -> None:
        """transformers' ``dynamic_frequency_update``: grow past the longest forward so
        far; back to the original frequencies below ``max_position_embeddings``."""
        cached, orig = self.max_seq_len_cached, self.spec.max_position_embeddings
        if seq_len > cached:
            self.inv_freq, self.attention_scaling = rope_frequencies(
                self.spec, seq_len, self.inv_freq.device)
            self.max_seq_len_cached = seq_len
        if seq_len < orig and cached > orig:
            self.inv_freq = self.original_inv_freq.clone()
            self.max_seq_len_cached = orig

    def forward(self, pos_BT: torch.Tensor,
                seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, head_dim] float32 of positions ``pos_BT``.

        ``seq_len``: the last position + 1 when the caller knows it on the host (a
        forward without a cache); else dynamic NTK reads it from the device (one sync
        per forward, as transformers) and longrope picks its factors on the device."""
        inv = self.inv_freq
        if self.spec.rope_type == "dynamic" and pos_BT.numel():
            self._dynamic_update(seq_len if seq_len is not None else int(pos_BT.max()) + 1)
            inv = self.inv_freq
        elif self.spec.rope_type == "longrope" and pos_BT.numel():
            orig = self.spec.original_max_position_embeddings
            if seq_len is not None:
                inv = self.long_inv_freq if seq_len > orig else self.inv_freq
            else:
                inv = torch.where(pos_BT.max() + 1 > orig, self.long_inv_freq, self.inv_freq)
        freqs = pos_BT[..., None].float() * inv.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
