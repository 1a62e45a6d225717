"""The E_local experts of one rank as batched weights, run block by block on sorted tokens.

Weights are one tensor per projection rather than a ModuleList: one parameter per
projection keeps optimizer state, checkpoint resharding and expert-parallel slicing simple.
Names and shapes (E = local experts, d = d_model, f = d_ffn; suffixes give the layout):

- ``gelu_mlp``: ``w1`` [E, d, f], ``b1`` [E, f], ``w2`` [E, f, d], ``b2`` [E, d]
  (``y = gelu(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``; without biases b1 / b2 are None).
- ``swiglu`` / ``geglu``: ``gate_up_proj`` [E, 2f, d] (rows [0, f) the gate, [f, 2f) the up
  projection) and ``down_proj`` [E, d, f]: ``y = (act(x Wg^T) * (x Wu^T)) Wd^T``, no biases.
  This is Hugging Face transformers 5.x's fused layout (``MixtralExperts``,
  ``Qwen3MoeExperts``...): its tensors load as they are, a per-expert checkpoint
  (``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj``) by stacking
  [gate; up] rows.

Kernels (``kernel``; the code is in ``moebit.moe.kernels``, ``moebit.moe.threaded`` and
``moebit.moe.grouped``): "loop" (one matmul per expert on exactly its rows), "threaded"
(the loop's experts spread over the CPU threads, each GEMM single-threaded), "padded"
(batched matmuls over blocks padded to the largest), "grouped"
(``torch.nn.functional.grouped_mm``) and "auto".

What "auto" picks on CPU with more than one intra-op thread: "threaded". Measured in
process, interleaved, on a loaded 2-core host (issue 16, SwiGLU d 512, f 1360, top-2,
dropless): the Mixtral MoE block forward+backward on 2048 tokens over 16 experts took
1204 ms (median; best 962) against 2851 ms for the loop and 2353 ms for transformers'
grouped_mm experts, using 663 ms of CPU against 1650 and 1488 (the loop's and
grouped_mm's per-expert GEMMs split over 2 threads spend the rest waiting at barriers);
in inference mode at E=64 it was faster than the loop from 1 token to 512 (best of 15),
but decoding the 4-layer Mixtral of issue 16 at E=16 on a quiet host (one process,
interleaved, medians of 3) it was slower: 10.6 against 7.0 ms per step at batch 1, 56.6
against 40.1 ms at batch 16 (1-3 rows per expert), so auto takes it only for blocks of at
least ``threaded_min_rows`` = 64 rows on average.

What "auto" picks with one thread, from measurements (docs/benchmarks.md, 2 threads at
the time, d 512, f 2048):

- padded against loop, on the whole GELU layer (4096 tokens, top-2 over 64 experts,
  capacity factor 1, medians of 5): forward+backward 954 ms padded against 1036 ms for the
  loop in float32, 470 against 516 ms in bfloat16. With larger blocks (E=8, 512-1024 rows)
  one matmul per block already keeps both threads busy, and with skewed or dropless
  routing padding would cost up to E x S rows, so auto pads only small blocks (at most
  ``pad_below_rows`` = 192 rows on average) when padding adds at most ``pad_limit`` (25%).
- grouped on CPU: torch 2.13's CPU grouped_mm is slower than the per-expert loop at every
  shape measured (one [rows, 512] x [512, 2048] product per expert: E=64 x 128 rows 99-116
  against 80-97 ms in float32, 47-53 against 33 ms in bf16; E=8 x 1024 rows 81 against
  66-68 ms, 27 against 12-23 ms), so auto never picks it on CPU.
- on a heavily loaded host (load 17-29 on 2 cores, docs/benchmarks.md issue 15) the padded
  SwiGLU kernel beat the loop by 13-35% even on dropless, uneven blocks, where this rule
  picks the loop; the rule stays as measured on the quiet host until a quiet re-run.
- grouped on CUDA (sm80+, where ``grouped_mm_supported``): picked by auto. Not measured
  here (no GPU was lent to this work): one grouped GEMM per projection replaces E kernel
  launches per projection, which is the reason torchtitan and Megatron-Core default to it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moebit.moe.grouped import _GroupedExperts, grouped_mm_supported
from moebit.moe.kernels import EXPERT_TYPES, _LoopExperts, _PaddedExperts
from moebit.moe.threaded import _ThreadedExperts

_KERNEL_FNS = {"loop": _LoopExperts, "padded": _PaddedExperts, "grouped": _GroupedExperts,
               "threaded": _ThreadedExperts}


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

    ``kernel`` ("auto", "loop", "padded", "grouped") may be changed at any time; auto's
    rule is in the module docstring. The padded path's memory is bounded by ``pad_limit``,
    so skewed or dropless routing never pads E x S rows.
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
        if bias and gated:
            raise ValueError(f"expert_bias: {expert_type!r} experts have no biases")
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.num_local = num_local
        self.d_model = d_model
        self.d_ffn = d_ffn
        self.expert_type = expert_type
        self.has_bias = bias
        self.grad_scale = 1.0
        self.kernel = kernel
        self.pad_limit = 0.25
        self.pad_below_rows = 192
        # threaded only for blocks of at least this many rows on average (training, long
        # prefills): at decode's 1-3 rows per expert its hand-off costs more than it saves
        self.threaded_min_rows = 64
        kw = {"dtype": dtype, "device": device}
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * d_ffn, d_model, **kw))
            self.down_proj = nn.Parameter(torch.empty(num_local, d_model, d_ffn, **kw))
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
        return self.gate_up_proj, None, self.down_proj, None

    def _init_plan(self) -> list[tuple[torch.Tensor, int]]:
        if self.expert_type == "gelu_mlp":
            plan = [(self.w1, self.d_model), (self.b1, self.d_model),
                    (self.w2, self.d_ffn), (self.b2, self.d_ffn)]
            return [(p, fan_in) for p, fan_in in plan if p is not None]
        return [(self.gate_up_proj, self.d_model), (self.down_proj, self.d_ffn)]

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
        fn = _KERNEL_FNS[self.choose_kernel(counts, x_ND.device, x_ND.dtype)]
        with torch.autocast(dev, enabled=False):
            return fn.apply(x_ND, w_up, b_up, w_down, b_down, list(counts), self.grad_scale,
                            self.expert_type)

    def choose_kernel(
        self, counts: list[int], device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32, threads: int | None = None,
    ) -> str:
        """The kernel this call runs: ``kernel`` itself, or auto's measured rule
        (``threads``: the intra-op thread count; default ``torch.get_num_threads()``)."""
        if self.kernel not in self.KERNELS:
            raise ValueError(f"Experts.kernel must be one of {self.KERNELS}, got {self.kernel!r}")
        rows, n = sum(counts), len(counts)
        if rows == 0:
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
        if torch.device(device).type == "cuda" and grouped_mm_supported(device, dtype):
            return "grouped"
        threads = torch.get_num_threads() if threads is None else threads
        busy = sum(1 for c in counts if c)
        if (torch.device(device).type == "cpu" and threads > 1 and busy > 1
                and rows >= self.threaded_min_rows * busy):
            return "threaded"
        padded = (n > 1 and rows <= self.pad_below_rows * n
                  and n * max(counts) <= (1 + self.pad_limit) * rows)
        return "padded" if padded else "loop"

    def _use_padded(self, counts: list[int]) -> bool:
        """Whether the one-thread rule pads these blocks."""
        return self.choose_kernel(counts, threads=1) == "padded"

    def extra_repr(self) -> str:
        return (f"{self.expert_type} experts {self.first_expert}.."
                f"{self.first_expert + self.num_local - 1} of {self.num_experts}, "
                f"d_model={self.d_model}, d_ffn={self.d_ffn}, bias={self.has_bias}")
