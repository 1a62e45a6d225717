"""Server metrics in the Prometheus text format, with no dependency beyond the stdlib.

Counters, gauges and histograms are updated by the engine thread and read by the HTTP
thread; a lock keeps a scrape consistent. Expert load is counted where routing decides
it, by wrapping each MoE gate's ``choose`` (every token's chosen experts, per layer).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from moebit.moe import TopKGate

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets, self.counts = buckets, [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


class Metrics:
    """What the server counts; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.requests: dict[str, int] = {}  # finish reason (stop, length, cancelled, error, rejected) -> n
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.queue_depth = 0
        self.running = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of recent steps
        self.expert_load: dict[int, torch.Tensor] = {}  # layer -> tokens routed per expert
        self.prefix_cache: Any = None  # the engine's serve.prefix_cache.PrefixCache, if any

    def finished(self, reason: str) -> None:
        with self.lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1

    def tokens_out(self, n: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.output_tokens += n
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - 10:
                self._recent.pop(0)

    def tokens_per_s(self) -> float:
        """Output tokens per second over the last 10 seconds."""
        now = time.monotonic()
        window = min(10.0, max(now - self.started, 1e-3))
        return sum(n for t, n in self._recent if t >= now - window) / window

    def watch_experts(self, model: torch.nn.Module) -> None:
        """Count each MoE layer's routed tokens per expert, where its gate chooses them."""
        for layer, gate in enumerate(g for g in model.modules() if isinstance(g, TopKGate)):
            self.expert_load[layer] = torch.zeros(gate.num_experts, dtype=torch.long)
            gate.choose = self._counting(gate.choose, layer, gate.num_experts)

    def _counting(self, choose: Callable, layer: int, n_experts: int) -> Callable:
        def counted(x_SD: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = choose(x_SD)
            counts_E = torch.bincount(out[2].reshape(-1).cpu(), minlength=n_experts)
            with self.lock:
                self.expert_load[layer] += counts_E
            return out
        return counted

    def _prefix_lines(self) -> list[str]:
        """The prefix cache's counters (none without one): lookups are joining requests,
        hits those that reused at least one block, tokens the prompt tokens not prefilled."""
        pc = self.prefix_cache
        if pc is None:
            return []
        return ["# HELP moebit_prefix_cache_lookups_total Joining requests looked up.",
                "# TYPE moebit_prefix_cache_lookups_total counter",
                f"moebit_prefix_cache_lookups_total {pc.lookups}",
                "# HELP moebit_prefix_cache_hits_total Requests that reused a cached prefix.",
                "# TYPE moebit_prefix_cache_hits_total counter",
                f"moebit_prefix_cache_hits_total {pc.hits}",
                "# HELP moebit_prefix_cache_tokens_reused_total Prompt tokens copied, not prefilled.",
                "# TYPE moebit_prefix_cache_tokens_reused_total counter",
                f"moebit_prefix_cache_tokens_reused_total {pc.tokens_reused}",
                "# HELP moebit_prefix_cache_tokens Tokens of keys/values the cache holds.",
                "# TYPE moebit_prefix_cache_tokens gauge",
                f"moebit_prefix_cache_tokens {pc.tokens}"]

    def render(self) -> str:
        with self.lock:
            lines = ["# HELP moebit_requests_total Requests finished, by reason.",
                     "# TYPE moebit_requests_total counter"]
            lines += [f'moebit_requests_total{{reason="{r}"}} {n}' for r, n in sorted(self.requests.items())]
            lines += ["# TYPE moebit_prompt_tokens_total counter",
                      f"moebit_prompt_tokens_total {self.prompt_tokens}",
                      "# TYPE moebit_output_tokens_total counter",
                      f"moebit_output_tokens_total {self.output_tokens}",
                      "# HELP moebit_output_tokens_per_second Output tokens/s over the last 10 s.",
                      "# TYPE moebit_output_tokens_per_second gauge",
                      f"moebit_output_tokens_per_second {self.tokens_per_s():.3f}",
                      "# TYPE moebit_queue_depth gauge", f"moebit_queue_depth {self.queue_depth}",
                      "# TYPE moebit_running_requests gauge", f"moebit_running_requests {self.running}",
                      "# HELP moebit_time_to_first_token_seconds Arrival to first token.",
                      "# TYPE moebit_time_to_first_token_seconds histogram",
                      *self.ttft.lines("moebit_time_to_first_token_seconds"),
                      "# HELP moebit_inter_token_latency_seconds Time between a request's tokens.",
                      "# TYPE moebit_inter_token_latency_seconds histogram",
                      *self.itl.lines("moebit_inter_token_latency_seconds"),
                      *self._prefix_lines(),
                      "# HELP moebit_expert_tokens_total Tokens routed to each expert (top-k picks).",
                      "# TYPE moebit_expert_tokens_total counter"]
            for layer, counts in sorted(self.expert_load.items()):
                lines += [f'moebit_expert_tokens_total{{layer="{layer}",expert="{e}"}} {int(c)}'
                          for e, c in enumerate(counts.tolist())]
        return "\n".join(lines) + "\n"
