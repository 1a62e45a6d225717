"""The whole decode step of a Hugging Face MoE decoder in one native call.

    fused = attach(model)        # after quantize_model_ (or on a float32 model)
    model.decode_step_reason     # None when attached, else why the modules stay
    generate_tokens(model, ...)  # steps of one token per row now run natively

Why: at batch 1 a decode step reads a few MB of weights, which the native GEMVs stream
in about a millisecond, while the torch modules around them (norms, RoPE, the cache
write, attention, routing, the expert loop: hundreds of small ops) cost several: on a
Mixtral of hidden 1024 and 8 layers, 3.5 of the 10 ms of an int8 step were GEMVs. One
native call per step (``_fused_c``) does the same arithmetic without the dispatch.

What it serves: the Mixtral-style path of ``HFDecoder`` (Mixtral, Qwen3-MoE with its
per-head q/k norms; every layer an MoE layer of SwiGLU experts, softmax routing with or
without renormalised top-k) in float32 on one rank, weights float32 or quantized by
``quantize_model_`` (int8 / int4 whose K is whole groups), for every step of one token
per row of a cache that says where the rows read and write (``decode_rows``: a
``generate`` batch's ``KVCache`` with left padding and finished rows, the serving
engine's slots, its packed steps of decode rows alone). Anything else (MLA, sinks,
windows, OLMoE's whole-projection q/k norms, dense layers, sigmoid or group-limited
routing, shared experts, expert parallelism, bf16; prefill and steps that carry a prompt
chunk) keeps the module path: ``attach`` names the part in ``model.decode_step_reason``,
and the step returns None for a call it does not serve, so the model's own forward runs
it. ``MOEBIT_FUSED_DECODE=0`` turns it off.

The step reads the weights where the modules hold them (no copy, so in-place updates
are seen). It checks once per cache that the modules and tensors it was built from are
still in place (a later ``quantize_*`` or ``.to()`` needs a new ``attach``, which
``generate_tokens`` and the serving engine make).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from typing import Any

import torch
from torch import nn

from moebit.inference import _fused_c
from moebit.inference.quantize import QuantExperts
from moebit.inference.quantize_dense import QuantLinear
from moebit.models.interface import ModelOutput
from moebit.models.kv_cache import DecodeRows, KVCache
from moebit.moe import MoE
from moebit.moe.experts import Experts

MAX_ROWS = 64  # rows a step takes (decode batches; the GEMV kernels' sweet spot is 1-16)
KV_DTYPES = (torch.float32, torch.float16)  # caches the step reads and writes in place


class Unsupported(ValueError):
    """The model has a part the native step does not implement (the message names it)."""


def _f32(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` itself (its storage, read in place) if float32, contiguous, on the CPU."""
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise Unsupported(f"{what} is {t.dtype} on {t.device}; the native step takes float32 "
                          f"on the CPU")
    return _dense(t, what).detach()


def _dense(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise Unsupported(f"{what} is not contiguous (the native step reads it in place)")
    return t


class _Weights:
    """Keeps every tensor the C structs point to alive, and what they came from."""

    def __init__(self) -> None:
        self.keep: list[torch.Tensor] = []
        self.sources: list[tuple[Any, str, Any]] = []  # (owner, attribute, object read)

    def ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self.keep.append(t)
        return t.data_ptr()

    def watch(self, owner: Any, attr: str) -> Any:
        obj = getattr(owner, attr)
        self.sources.append((owner, attr, obj))
        return obj

    def fresh(self) -> bool:
        return all(getattr(o, a) is obj for o, a, obj in self.sources)


def _linear(w: _Weights, mod: nn.Module, k: int, what: str) -> _fused_c.Lin:
    """A dense projection: ``nn.Linear`` (float32) or ``QuantLinear`` (int8 / int4)."""
    if isinstance(mod, QuantLinear):
        n, kp = mod.out_features, mod.q.shape[-1] * (2 if mod.bits == 4 else 1)
        if kp != k:
            raise Unsupported(f"{what}: quantized with K padded {k} -> {kp}")
        w.sources.append((mod, "q", mod.q))
        w.sources.append((mod, "s", mod.s))
        groups = mod.s.numel() // n
        return _fused_c.Lin(w.ptr(_dense(mod.q, what)), w.ptr(_dense(mod.s, what)), w.ptr(mod.bias), n, kp,
                            kp // groups, mod.bits, 0, 0)
    if isinstance(mod, nn.Linear):
        wt = _f32(w.watch(mod, "weight"), f"{what}.weight")
        b = None if mod.bias is None else _f32(w.watch(mod, "bias"), f"{what}.bias")
        return _fused_c.Lin(w.ptr(wt), None, w.ptr(b), mod.out_features, k, 0, 32, 0, 0)
    raise Unsupported(f"{what} is a {type(mod).__name__}, not a Linear")


def _experts(w: _Weights, ex: nn.Module, d: int, f: int, what: str) -> tuple[_fused_c.Lin, _fused_c.Lin]:
    """(gate/up, down) of one layer's experts, stacked: weights [E, N, K] with a stride."""
    if getattr(ex, "num_local", None) != getattr(ex, "num_experts", None):
        raise Unsupported(f"{what}: holds {ex.num_local} of {ex.num_experts} experts")
    if ex.expert_type != "swiglu" or ex.act != "swiglu":
        raise Unsupported(f"{what}: {ex.act} experts (the step runs SwiGLU)")
    if isinstance(ex, QuantExperts):
        if ex.b_up is not None or ex.b_down is not None:
            raise Unsupported(f"{what}: expert biases")
        out = []
        for which, n, k in (("up", 2 * f, d), ("down", d, f)):
            q, s = w.watch(ex, f"q_{which}"), w.watch(ex, f"s_{which}")
            e = q.shape[0]
            kp = q.shape[-1] * (2 if ex.bits == 4 else 1)
            if kp != k:
                raise Unsupported(f"{what}.{which}: quantized with K padded {k} -> {kp}")
            groups = s.numel() // (e * n)
            out.append(_fused_c.Lin(w.ptr(_dense(q, what)), w.ptr(_dense(s, what)), None, n, kp,
                                    kp // groups, ex.bits, q[0].numel() * q.element_size(),
                                    s[0].numel()))
        return out[0], out[1]
    if isinstance(ex, Experts):
        if ex.has_bias:
            raise Unsupported(f"{what}: expert biases")
        up = _f32(w.watch(ex, "gate_up_proj"), f"{what}.gate_up_proj")
        down = _f32(w.watch(ex, "down_proj"), f"{what}.down_proj")
        if tuple(up.shape[1:]) != (2 * f, d) or tuple(down.shape[1:]) != (d, f):
            raise Unsupported(f"{what}: expert weights {tuple(up.shape)} / {tuple(down.shape)}")
        return (_fused_c.Lin(w.ptr(up), None, None, 2 * f, d, 0, 32, up[0].numel() * 4, 0),
                _fused_c.Lin(w.ptr(down), None, None, d, f, 0, 32, down[0].numel() * 4, 0))
    raise Unsupported(f"{what} is a {type(ex).__name__}")


def _check_config(model: nn.Module) -> None:
    c = model.config
    named = [("multi-head latent attention", c.is_mla), ("attention sinks", c.attention_sinks),
             ("sliding windows", c.sliding_window is not None),
             ("q/k norms over whole projections", c.qk_norm == "full"), ("clip_qkv", c.clip_qkv is not None),
             ("post-norm blocks", c.post_norm),
             ("expert parallelism", getattr(model, "ep_groups", None) is not None)]
    for what, present in named:
        if present:
            raise Unsupported(f"{what}")
    if c.num_heads % c.num_kv_heads:
        raise Unsupported(f"{c.num_heads} heads over {c.num_kv_heads} key/value heads")


def _check_moe(moe: MoE, what: str) -> None:
    g, mc = moe.gate, moe.config
    if mc.scoring_func != "softmax":
        raise Unsupported(f"{what}: {mc.scoring_func} routing")
    if g.e_score_correction_bias is not None or (mc.n_group > 1 and mc.groups_kept < mc.n_group):
        raise Unsupported(f"{what}: biased or group-limited expert selection")
    if moe.shared_expert is not None:
        raise Unsupported(f"{what}: shared experts")


def _check_int8_activations(layers: Any, m: _fused_c.Model, *widths: int) -> None:
    """8-bit activation blocks need whole blocks of 32 in every activation (a head's
    too: each head quantizes its own), and quantized weights whose scales meet them:
    int4 in groups of 32 (the blocks are the groups), int8 in groups of 32 or per
    output channel."""
    if any(w % 32 for w in widths):
        raise Unsupported(f"int8 activations: widths {widths} (hidden, heads x head_dim, "
                          f"expert width, head_dim: multiples of 32)")
    lins = [m.head, *(getattr(ly, n) for ly in layers for n in ("q", "k", "v", "o", "up", "down"))]
    if not any(lin.bits in (4, 8) for lin in lins):
        raise Unsupported("int8 activations: no int4 or int8 weight to use them "
                          "(quantize with bits=4 or 8)")
    if any(lin.bits == 4 and lin.group != 32 for lin in lins):
        raise Unsupported("int8 activations: int4 weights must have groups of 32")
    if any(lin.bits == 8 and lin.group not in (32, lin.kp) for lin in lins):
        raise Unsupported("int8 activations: int8 weights must have groups of 32 or one "
                          "scale per output channel")


class FusedDecode:
    """The native step of one model; ``__call__`` runs a decode forward or returns None."""

    def __init__(self, model: nn.Module, lib: ctypes.CDLL, int8_activations: bool = False) -> None:
        _check_config(model)
        c = model.config
        self.lib, self.model = lib, model
        w = _Weights()
        d, h, hkv, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        layers = (_fused_c.Layer * c.num_layers)()
        f = e = k = None
        renorm, scaling = 1, 1.0
        for i, block in enumerate(w.watch(model, "blocks")):
            what = f"blocks.{i}"
            moe = w.watch(block, "mlp")
            if not isinstance(moe, MoE):
                raise Unsupported(f"{what}: a dense feed-forward layer")
            _check_moe(moe, f"{what}.mlp")
            mc = moe.config
            if f is None:
                f, e, k = mc.d_ffn, mc.num_experts, mc.num_experts_per_tok
                renorm = int(not mc.softmax_before_topk or (mc.norm_topk_prob and k > 1))
                scaling = float(mc.routed_scaling_factor)
            elif (mc.d_ffn, mc.num_experts, mc.num_experts_per_tok) != (f, e, k):
                raise Unsupported(f"{what}: experts differ between layers")
            attn = w.watch(block, "self_attn")
            ly = layers[i]
            ly.ln1 = w.ptr(_f32(w.watch(block.input_layernorm, "weight"), f"{what}.input_layernorm"))
            ly.ln2 = w.ptr(_f32(w.watch(block.post_attention_layernorm, "weight"),
                                f"{what}.post_attention_layernorm"))
            if c.qk_norm == "head":
                ly.qn = w.ptr(_f32(w.watch(attn.q_norm, "weight"), f"{what}.self_attn.q_norm"))
                ly.kn = w.ptr(_f32(w.watch(attn.k_norm, "weight"), f"{what}.self_attn.k_norm"))
            for name, k_in in (("q_proj", d), ("k_proj", d), ("v_proj", d), ("o_proj", h * dh)):
                setattr(ly, name[0], _linear(w, w.watch(attn, name), k_in, f"{what}.self_attn.{name}"))
            ly.router = _linear(w, w.watch(moe.gate, "router"), d, f"{what}.mlp.gate.router")
            ly.up, ly.down = _experts(w, w.watch(moe, "experts"), d, f, f"{what}.mlp.experts")
        self.layers = layers
        m = _fused_c.Model()
        m.n_layer, m.d, m.h, m.hkv, m.dh = c.num_layers, d, h, hkv, dh
        m.e, m.topk, m.f, m.vocab = e, k, f, c.vocab_size
        m.renorm, m.routed_scaling = renorm, scaling
        m.eps, m.scale = float(c.rms_norm_eps), 1.0 / math.sqrt(dh)
        if int8_activations:
            _check_int8_activations(layers, m, d, h * dh, f, dh)
        m.act8 = int(int8_activations)
        self.int8_activations = int8_activations
        m.wte = w.ptr(_f32(w.watch(model.wte, "weight"), "wte.weight"))
        m.norm = w.ptr(_f32(w.watch(model.norm, "weight"), "norm.weight"))
        m.head = _linear(w, w.watch(model, "lm_head"), d, "lm_head")
        m.layers = ctypes.addressof(layers)
        self.struct, self.weights = m, w
        self.steps = 0  # calls served natively
        # one step at a time: the scratch buffers are the model's (a server's engine
        # thread and a generate call in another thread may share a model)
        self.lock = threading.Lock()
        self._rows = self._threads = self._tmax = 0
        self._scratch: dict[str, torch.Tensor] = {}
        self._cache_ptrs: tuple[Any, Any, Any] | None = None  # (cache, k array, v array)
        self._checked: Any = None  # the last cache the modules were checked for
        # RoPE whose frequencies do not move with the sequence: cos / sin by position,
        # computed once (dynamic NTK and longrope rescale per call: computed each step)
        self.tabled = getattr(getattr(model.rotary_emb, "spec", None), "rope_type",
                               "default") not in ("dynamic", "longrope")
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._zero = torch.zeros(())

    def _ensure_scratch(self, rows: int, threads: int, tmax: int) -> None:
        if rows <= self._rows and threads <= self._threads and tmax <= self._tmax:
            return
        rows, threads = max(rows, self._rows), max(threads, self._threads)
        tmax = max(tmax, self._tmax)
        m = self.struct
        d, qn, kn, e, f, k = m.d, m.h * m.dh, m.hkv * m.dh, m.e, m.f, m.topk
        sizes = {"x": rows * d, "xn": rows * d, "qb": rows * qn, "kb": rows * kn,
                 "vb": rows * kn, "att": rows * qn, "ob": rows * d, "lg": rows * e,
                 "xe": rows * k * d, "hu": rows * k * 2 * f, "ha": rows * k * f,
                 "ye": rows * k * d, "sc": threads * tmax * (m.h // m.hkv), "sw": rows * k}
        ints = {"slot_row": rows * k, "act_e": e, "act_off": e, "act_n": e, "n_act": 2}
        if m.act8:  # 8-bit copies of the activations quantized products read, scales per 32
            for name, size in (("xn", rows * d), ("att", rows * qn), ("xe", rows * k * d),
                               ("ha", rows * k * f)):
                sizes[name + "d"] = sizes[name + "c"] = size // 32
                ints[name + "q"] = size
        self._scratch = {n: torch.zeros(max(1, s)) for n, s in sizes.items()}
        self._scratch.update({n: torch.zeros(max(1, s), dtype=torch.int8 if n.endswith("q")
                                             else torch.int64) for n, s in ints.items()})
        for n, t in self._scratch.items():
            setattr(m, n, t.data_ptr())
        m.rows_max, m.threads_max, m.tmax_max = rows, threads, tmax
        self._rows, self._threads, self._tmax = rows, threads, tmax

    def _pointers(self, cache: KVCache) -> tuple[Any, Any]:
        held = self._cache_ptrs
        if held is None or held[0] is not cache:
            n = len(cache.k)
            held = (cache, (ctypes.c_void_p * n)(*(t.data_ptr() for t in cache.k)),
                    (ctypes.c_void_p * n)(*(t.data_ptr() for t in cache.v)))
            self._cache_ptrs = held
        return held[1], held[2]

    def decode_rows(self, input_ids: torch.Tensor, cache: Any) -> DecodeRows | None:
        """Where the tokens of a call the native step serves read and write, else None:
        a step of one token per row of a cache that says so (``decode_rows``: a batch's
        ``KVCache``, the serving engine's slots, a packed step of decode rows alone)."""
        if (torch.is_grad_enabled() or self.model.training or input_ids.dim() != 2
                or not hasattr(cache, "decode_rows")):
            return None
        b, t = input_ids.shape
        if not 1 <= b * t <= MAX_ROWS:
            return None
        rows = cache.decode_rows(b, t)
        return rows if rows is not None and self.serves(rows.cache) else None

    def serves(self, cache: KVCache) -> bool:
        """Whether a native call may read and write ``cache``'s buffers (float32 or
        float16, one per layer, contiguous) with this model's weights still the ones it
        was built from."""
        k0 = cache.k[0]
        if (k0.dtype not in KV_DTYPES or not k0.is_contiguous()
                or len(cache.k) != self.struct.n_layer):
            return False
        if self._checked is not cache:
            if not self.weights.fresh():
                return False
            self._checked = cache
        return True

    def __call__(self, input_ids: torch.Tensor, cache: Any,
                 logits_to_keep: int | torch.Tensor = 0) -> ModelOutput | None:
        rows = self.decode_rows(input_ids, cache)
        if rows is None:
            return None
        with self.lock:
            return self._step(input_ids, cache, rows, logits_to_keep)

    def _step(self, input_ids: torch.Tensor, cache: Any, rows: DecodeRows,
              logits_to_keep: int | torch.Tensor) -> ModelOutput:
        b, t = input_ids.shape
        cols = head_columns(t, logits_to_keep)
        hrows = None if cols is None else (torch.arange(b)[:, None] * t + cols).reshape(-1)
        logits = self.run(input_ids.reshape(-1), rows, hrows)
        cache.advance(t)
        self.steps += 1
        logits = logits.view(b, t if cols is None else cols.numel(), self.struct.vocab)
        return ModelOutput(logits, None, self._zero, [])

    def run(self, ids: torch.Tensor, rows: DecodeRows,
            hrows: torch.Tensor | None = None) -> torch.Tensor:
        """One native call of the tokens ``ids`` [n] where ``rows`` says: the logits of
        the tokens ``hrows`` names [len(hrows), V] (None: of every token). Call under the
        lock; the cache is not advanced."""
        ids = ids.contiguous()
        n = ids.numel()
        cos, sin, slot, first, col, kc, vc, threads = self.native_args(rows, n)
        logits = torch.empty(n if hrows is None else hrows.numel(), self.struct.vocab)
        rc = self.lib.fd_step(ctypes.byref(self.struct), n, ids.data_ptr(), cos.data_ptr(),
                              sin.data_ptr(), cos.shape[-1], self.tabled, slot.data_ptr(),
                              first.data_ptr(), col.data_ptr(),
                              None if rows.live is None else rows.live.data_ptr(), kc, vc,
                              rows.cache.capacity, logits.data_ptr(), threads,
                              None if hrows is None or not hrows.numel() else hrows.data_ptr(),
                              -1 if hrows is None else hrows.numel())
        if rc == 3:
            raise IndexError(f"a token id of {ids.tolist()} is outside the vocabulary "
                             f"({self.struct.vocab})")
        if rc != 0:
            raise RuntimeError(f"native decode step refused its arguments (code {rc})")
        return logits

    def native_args(self, rows: DecodeRows, n: int) -> tuple[Any, ...]:
        """What a native call of ``n`` tokens at ``rows`` reads besides the tokens: cos,
        sin (tables by position when ``tabled``), slot, first, col, the cache's key and
        value pointers, threads; the scratch is grown to fit first. Call under the lock."""
        base = rows.cache
        threads = torch.get_num_threads()
        self._ensure_scratch(n, threads, base.capacity)
        if self.tabled:
            cos, sin = self._rope_table(base.capacity)
        else:
            pos = (rows.col - rows.first)[:, None]
            cos, sin = (x.reshape(n, -1).contiguous() for x in self.model.rotary_emb(pos))
        slot, first, col = (x.contiguous() for x in (rows.slot, rows.first, rows.col))
        self.struct.kvh = int(base.k[0].dtype == torch.float16)
        return (cos, sin, slot, first, col, *self._pointers(base), threads)

    def _rope_table(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [capacity, rw] by position, computed once (and when a cache is longer)."""
        if self._rope is None or self._rope[0].shape[0] < capacity:
            cos, sin = self.model.rotary_emb(torch.arange(capacity)[None])
            self._rope = (cos[0].contiguous(), sin[0].contiguous())
        return self._rope


def head_columns(t: int, logits_to_keep: int | torch.Tensor) -> torch.Tensor | None:
    """The columns of a [b, t] step whose logits are wanted (``keep_columns``' rule), or
    None for all of them: the head, the widest product, runs on those rows only."""
    if isinstance(logits_to_keep, torch.Tensor):
        cols = logits_to_keep.reshape(-1).to("cpu", torch.int64)
        if cols.numel() and not bool(((cols >= 0) & (cols < t)).all()):
            raise IndexError(f"logits_to_keep {cols.tolist()} outside the step's {t} columns")
        return cols
    if not logits_to_keep or logits_to_keep >= t:
        return None
    return torch.arange(t - logits_to_keep, t)


def enabled() -> bool:
    return os.environ.get("MOEBIT_FUSED_DECODE", "1") != "0"


def attach(model: nn.Module, isa: str | None = None, auto: bool = False,
           int8_activations: bool | None = None) -> FusedDecode | None:
    """Give ``model`` (an ``HFDecoder``) the native decode step; returns it, or None when
    it cannot serve this model (``model.decode_step_reason`` says why) or is turned off.
    Idempotent: a step already attached and still current is returned as it is.
    ``auto`` (``generate_tokens``): leave a model that ``detach`` turned off as it is.

    ``int8_activations``: int4 and int8 weights multiply activations rounded to 8 bits
    in blocks of 32 (llama.cpp's Q4_0 / Q8_0 x Q8_0), integer dot products instead of
    widening every weight to a float: faster, and no longer the module path's arithmetic (each
    activation moves by up to half its block's step, max|x| / 254). Off by default;
    None keeps what an attached step has."""
    if auto and getattr(model, "decode_step_off", False):
        return None
    model.decode_step_off = False
    held = getattr(model, "decode_step", None)
    if int8_activations is None:
        int8_activations = isinstance(held, FusedDecode) and held.int8_activations
    if (isinstance(held, FusedDecode) and held.weights.fresh() and isa is None
            and held.int8_activations == int8_activations):
        return held
    model.decode_step = None
    if not hasattr(model, "rotary_emb") or not hasattr(model.config, "qk_norm"):
        model.decode_step_reason = f"{type(model).__name__} is not a Hugging Face decoder"
        return None
    if not enabled():
        model.decode_step_reason = "MOEBIT_FUSED_DECODE=0"
        return None
    lib = _fused_c.load(isa)
    if lib is None:
        model.decode_step_reason = "the native build is unavailable"
        return None
    try:
        fused = FusedDecode(model, lib, int8_activations)
    except Unsupported as e:
        model.decode_step_reason = str(e)
        return None
    model.decode_step, model.decode_step_reason = fused, None
    return fused


def use_int8_activations(model: nn.Module) -> FusedDecode:
    """``--activations int8``: attach the step with 8-bit activations for the int4 and
    int8 products, or a ValueError naming what stands in the way."""
    fused = attach(model, int8_activations=True)
    if fused is None:
        raise ValueError(f"--activations int8 needs the native decode step with int4 or "
                         f"int8 weights (--quantize int4|int8): {model.decode_step_reason}")
    return fused


def detach(model: nn.Module) -> None:
    """Back to the module path for every decode step, until ``attach`` is called again."""
    model.decode_step, model.decode_step_off = None, True
    model.decode_step_reason = "turned off (fused_decode.detach)"
