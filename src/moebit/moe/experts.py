"""The E_local experts of one rank as batched weights, run block by block on sorted tokens.

Weights are one tensor per projection rather than a ModuleList: one parameter per
projection keeps optimizer state, checkpoint resharding and expert-parallel slicing simple.
Names and shapes (E = local experts, d = d_model, f = d_ffn; suffixes give the layout):

- ``gelu_mlp``: ``w1`` [E, d, f], ``b1`` [E, f], ``w2`` [E, f, d], ``b2`` [E, d]
  (``y = gelu(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``; without biases b1 / b2 are None).
- ``swiglu`` / ``geglu``: ``gate_up_proj`` [E, 2f, d] (rows [0, f) the gate, [f, 2f) the up
  projection) and ``down_proj`` [E, d, f]: ``y = (act(x Wg^T) * (x Wu^T)) Wd^T``; with
  biases (gpt-oss) ``gate_up_proj_bias`` [E, 2f] and ``down_proj_bias`` [E, d]. ``act``
  may replace SiLU by gpt-oss's clamped SwiGLU (``moebit.moe.glu.ClampedSwiGLU``).
  This is Hugging Face transformers 5.x's fused layout (``MixtralExperts``,
  ``Qwen3MoeExperts``...): its tensors load as they are, a per-expert checkpoint
  (``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj``) by stacking
  [gate; up] rows.

Kernels (``kernel``; the code is in ``moebit.moe.kernels``, ``moebit.moe.threaded`` and
``moebit.moe.grouped``): "loop" (one matmul per expert on exactly its rows), "threaded"
(the loop's experts spread over the CPU threads, each GEMM single-threaded), "padded"
(batched matmuls over blocks padded to the largest), "grouped"
(``torch.nn.functional.grouped_mm``) and "auto".

What "auto" picks on CPU: whichever candidate ran fastest here, measured on first use
(``moebit.moe.autotune``): the first forward for a problem key (expert type, shapes,
dtype, thread count, training or inference, and the total rows, rows per busy expert and
busy experts each rounded up to a power of two) times every candidate on that call's
real blocks (forward in inference, forward+backward in training; interleaved, median of
5) and caches the fastest on disk per machine (CPU model, ISA, torch version). The
candidates: "loop" always; "padded" where padding adds at most ``pad_limit`` (25%) rows
(a memory bound, not a timing rule: skewed or dropless routing would otherwise pad to
E x S rows); "threaded" with more than one intra-op thread and more than one busy
expert; "grouped" where this torch's CPU grouped_mm runs for the dtype. With
``MOEBIT_AUTOTUNE=0`` auto runs "loop", deterministically. ``moebit bench moe`` prints
each choice with every candidate's time.

Why measure instead of a rule: the measurements that once set thresholds here disagree
across hosts and loads (docs/benchmarks/huggingface.md, docs/benchmarks/swiglu-experts.md):
on a quiet 2-core host the threaded kernel beat the loop 2.4x for 2048-token training
blocks yet lost 1.5x when decoding at 1-3 rows per expert, and on a loaded host the padded
SwiGLU kernel beat the loop by 13-35% on blocks where the quiet host's rule took the loop.

- grouped on CUDA (sm80+, where ``grouped_mm_supported``): picked by auto. Not measured
  here (no GPU was lent to this work): one grouped GEMM per projection replaces E kernel
  launches per projection, which is the reason torchtitan and Megatron-Core default to it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moebit.moe import autotune
from moebit.moe.glu import ClampedSwiGLU
from moebit.moe.grouped import _GroupedExperts, grouped_mm_supported
from moebit.moe.kernels import EXPERT_TYPES, _LoopExperts, _PaddedExperts
from moebit.moe.threaded import _ThreadedExperts

_KERNEL_FNS = {"loop": _LoopExperts, "padded": _PaddedExperts, "grouped": _GroupedExperts,
               "threaded": _ThreadedExperts}


def _timed_call(fn, args: tuple, counts: list[int], kind: str, train: bool):
    """One run of kernel ``fn`` on copies of the inputs that share their storage:
    forward only in inference, forward+backward in training (gradients are discarded)."""
    if not train:
        def run() -> None:
            with torch.no_grad(), torch.autocast(args[0].device.type, enabled=False):
                fn.apply(*args, list(counts), 1.0, kind)
        return run
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad or i > 0)
              for i, t in enumerate(args)]

    def run_train() -> None:
        with torch.enable_grad(), torch.autocast(args[0].device.type, enabled=False):
            y = fn.apply(*leaves, list(counts), 1.0, kind)
            y.backward(torch.ones_like(y))
        for t in leaves:
            if t is not None:
                t.grad = None
    return run_train


class Experts(nn.Module):
    """The local experts of one MoE layer (``expert_type``, layouts in the module docstring).

    ``first_expert`` / ``num_local`` select which of the ``num_experts`` global experts this
    rank holds. Initialisation draws every global expert in order and keeps the local
    ones, so a model split over ep_size ranks starts with exactly the experts of the same
    model in one process (same seed), and the experts differ across ranks.

    ``grad_scale`` multiplies the weights' gradients. Expert parallelism sets it to
    1/ep_size: an expert's gradient then collects the tokens of ep_size ranks, and
    averaging it over the expert-data-parallel group (world/ep_size ranks) yields the
    same mean over all ranks that the dense parameters get from a world allreduce.

    ``kernel`` ("auto", "loop", "padded", "grouped", "threaded") may be changed at any
    time; auto measures its candidates (module docstring). The padded path's memory is
    bounded by ``pad_limit``, so skewed or dropless routing never pads E x S rows.
    ``last_tuned`` holds auto's most recent measurement (``autotune.Tuned``: choice and
    every candidate's time), ``tuned`` every choice this module used, by problem key.
    """

    KERNELS = ("auto", "loop", "padded", "grouped", "threaded")

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ffn: int,
        first_expert: int = 0,
        num_local: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        expert_type: str = "gelu_mlp",
        bias: bool | None = None,
        kernel: str = "auto",
        act: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        num_local = num_experts - first_expert if num_local is None else num_local
        if not 0 <= first_expert < num_experts or first_expert + num_local > num_experts:
            raise ValueError(
                f"local experts [{first_expert}, {first_expert + num_local}) are outside "
                f"the {num_experts} experts"
            )
        if expert_type not in EXPERT_TYPES:
            raise ValueError(f"expert_type must be one of {EXPERT_TYPES}, got {expert_type!r}")
        gated = expert_type != "gelu_mlp"
        bias = (not gated) if bias is None else bias
        if act is not None and expert_type != "swiglu":
            raise ValueError(f"a clamped SwiGLU activation needs expert_type 'swiglu', "
                             f"got {expert_type!r}")
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.num_local = num_local
        self.d_model = d_model
        self.d_ffn = d_ffn
        self.expert_type = expert_type
        # what the kernels run: the type, or the clamped SwiGLU (plain SwiGLU's constants: the type)
        self.act: str | ClampedSwiGLU = expert_type if act in (None, ClampedSwiGLU()) else act
        self.has_bias = bias
        self.grad_scale = 1.0
        self.kernel = kernel
        self.pad_limit = 0.25
        self.last_tuned: autotune.Tuned | None = None
        self.tuned: dict[str, autotune.Tuned] = {}  # auto's choices by problem key
        kw = {"dtype": dtype, "device": device}
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * d_ffn, d_model, **kw))
            self.down_proj = nn.Parameter(torch.empty(num_local, d_model, d_ffn, **kw))
            self.register_parameter("gate_up_proj_bias", nn.Parameter(
                torch.empty(num_local, 2 * d_ffn, **kw)) if bias else None)
            self.register_parameter("down_proj_bias", nn.Parameter(
                torch.empty(num_local, d_model, **kw)) if bias else None)
        else:
            self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_ffn, **kw))
            self.w2 = nn.Parameter(torch.empty(num_local, d_ffn, d_model, **kw))
            b1 = nn.Parameter(torch.empty(num_local, d_ffn, **kw)) if bias else None
            b2 = nn.Parameter(torch.empty(num_local, d_model, **kw)) if bias else None
            self.register_parameter("b1", b1)
            self.register_parameter("b2", b2)
        for p in self.parameters():
            p.moebit_expert = True  # found by split_params_for_ep and grad averaging
        self.reset_parameters()

    def projections(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(up weight, up bias, down weight, down bias) in their storage layouts."""
        if self.expert_type == "gelu_mlp":
            return self.w1, self.b1, self.w2, self.b2
        return self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias

    def _init_plan(self) -> list[tuple[torch.Tensor, int]]:
        if self.expert_type == "gelu_mlp":
            plan = [(self.w1, self.d_model), (self.b1, self.d_model),
                    (self.w2, self.d_ffn), (self.b2, self.d_ffn)]
            return [(p, fan_in) for p, fan_in in plan if p is not None]
        plan = [(self.gate_up_proj, self.d_model), (self.gate_up_proj_bias, self.d_model),
                (self.down_proj, self.d_ffn), (self.down_proj_bias, self.d_ffn)]
        return [(p, fan_in) for p, fan_in in plan if p is not None]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default init (U(+-1/sqrt(fan_in))) per expert, drawn in global order."""
        lo, hi = self.first_expert, self.first_expert + self.num_local
        for p, fan_in in self._init_plan():
            bound = 1.0 / math.sqrt(fan_in)
            scratch = torch.empty(p.shape[1:], dtype=p.dtype, device=p.device)
            for e in range(self.num_experts):
                if lo <= e < hi:
                    p[e - lo].uniform_(-bound, bound)
                else:
                    scratch.uniform_(-bound, bound)  # keep the RNG stream rank-independent

    def forward(self, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run expert e on rows [sum(counts[:e]), sum(counts[:e+1])) of ``x_ND``."""
        if len(counts) != self.num_local:
            raise ValueError(f"got {len(counts)} block sizes for {self.num_local} local experts")
        if sum(counts) != x_ND.shape[0]:
            raise ValueError(f"block sizes sum to {sum(counts)} but x has {x_ND.shape[0]} rows")
        w_up, b_up, w_down, b_down = self.projections()
        dev = x_ND.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x_ND, w_up, w_down = x_ND.to(dt), w_up.to(dt), w_down.to(dt)
            b_up, b_down = (None if b is None else b.to(dt) for b in (b_up, b_down))
        elif x_ND.dtype != w_up.dtype:
            x_ND = x_ND.to(w_up.dtype)
        args = (x_ND, w_up, b_up, w_down, b_down)
        fn = _KERNEL_FNS[self._pick(counts, args)]
        with torch.autocast(dev, enabled=False):
            return fn.apply(*args, list(counts), self.grad_scale, self.act)

    def candidates(self, counts: list[int], device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, threads: int | None = None) -> list[str]:
        """The kernels auto may take for these blocks on CPU ("loop" first)."""
        rows, n = sum(counts), len(counts)
        threads = torch.get_num_threads() if threads is None else threads
        out = ["loop"]
        if n > 1 and n * max(counts) <= (1 + self.pad_limit) * rows:
            out.append("padded")
        if threads > 1 and sum(1 for c in counts if c) > 1:
            out.append("threaded")
        if grouped_mm_supported(device, dtype):
            out.append("grouped")
        return out

    def tune_key(self, counts: list[int], dtype: torch.dtype, threads: int, train: bool) -> str:
        """The autotune problem key: shapes, dtype, threads, mode and bucketed row counts."""
        rows = sum(counts)
        busy = max(1, sum(1 for c in counts if c))
        b = autotune.rows_bucket
        return (f"experts|{self.act}|bias={self.has_bias}|E={len(counts)}|"
                f"d={self.d_model}|f={self.d_ffn}|{str(dtype).removeprefix('torch.')}|"
                f"threads={threads}|{'train' if train else 'infer'}|rows={b(rows)}|"
                f"per_expert={b(-(-rows // busy))}|busy={b(busy)}")

    def choose_kernel(
        self, counts: list[int], device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32, threads: int | None = None,
        train: bool | None = None,
    ) -> str:
        """The kernel this call runs: ``kernel`` itself, or for auto the only candidate, the
        choice measured for these blocks (see ``autotune``), else "loop" (nothing measured
        yet, or ``MOEBIT_AUTOTUNE=0``). ``threads``: default ``torch.get_num_threads()``;
        ``train``: default ``torch.is_grad_enabled()``."""
        if self.kernel not in self.KERNELS:
            raise ValueError(f"Experts.kernel must be one of {self.KERNELS}, got {self.kernel!r}")
        if sum(counts) == 0:
            return "loop"  # nothing to multiply: the loop allocates empty outputs only
        if self.kernel == "grouped":
            if not grouped_mm_supported(device, dtype):
                raise ValueError(
                    f"kernel = 'grouped': torch {torch.__version__} has no grouped_mm for "
                    f"{dtype} on {torch.device(device)}; use 'auto', 'loop' or 'padded'"
                )
            return "grouped"
        if self.kernel != "auto":
            return self.kernel
        if torch.device(device).type == "cuda":
            return "grouped" if grouped_mm_supported(device, dtype) else "loop"
        cands = self.candidates(counts, device, dtype, threads)
        if len(cands) == 1:
            return "loop"
        threads = torch.get_num_threads() if threads is None else threads
        train = torch.is_grad_enabled() if train is None else train
        hit = autotune.cached(self.tune_key(counts, dtype, threads, train))
        return hit.choice if hit is not None and hit.choice in cands else "loop"

    def _pick(self, counts: list[int], args: tuple) -> str:
        """``choose_kernel``, but auto on CPU measures its candidates on these inputs (once
        per problem key and machine) where no choice is known yet."""
        x_ND = args[0]
        if (self.kernel != "auto" or x_ND.device.type != "cpu" or not autotune.enabled()
                or sum(counts) == 0):
            return self.choose_kernel(counts, x_ND.device, x_ND.dtype)
        cands = self.candidates(counts, x_ND.device, x_ND.dtype)
        if len(cands) == 1:
            return cands[0]
        train = torch.is_grad_enabled()
        key = self.tune_key(counts, x_ND.dtype, torch.get_num_threads(), train)
        hit = autotune.cached(key)
        if hit is not None and hit.choice in cands:
            self.tuned[key] = hit
            return hit.choice
        runs = {k: _timed_call(_KERNEL_FNS[k], args, counts, self.act, train)
                for k in cands}
        self.last_tuned = self.tuned[key] = autotune.choose(key, runs, default="loop")
        return self.last_tuned.choice

    def _use_padded(self, counts: list[int]) -> bool:
        """Whether one thread without tuning data would pad these blocks."""
        return self.choose_kernel(counts, threads=1) == "padded"

    def extra_repr(self) -> str:
        return (f"{self.act} experts {self.first_expert}.."
                f"{self.first_expert + self.num_local - 1} of {self.num_experts}, "
                f"d_model={self.d_model}, d_ffn={self.d_ffn}, bias={self.has_bias}")
