"""Text generation with a KV cache.

Every rank of an expert-parallel model must run the same decoding steps (each MoE layer
exchanges tokens with the ranks that own their experts), so generation is seeded and
deterministic: ranks that call it with the same arguments produce the same text.
"""

from __future__ import annotations

import torch

from moebit.models.gpt import GPT


@torch.no_grad()
def generate(
    model: GPT,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    use_cache: bool = True,
) -> list[str]:
    """Continue each prompt; returns the generated continuations (without the prompt).

    Prompts of different lengths are decoded one at a time; ``temperature=0`` is greedy.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    outs = []
    try:
        for prompt in prompts:
            ids = list(prompt.encode("utf-8")) or [10]
            room = model.config.block_size - len(ids)
            if room < 1:
                ids = ids[-(model.config.block_size - 1):]
                room = 1
            n_new = min(max_new_tokens, room)
            idx = torch.tensor([ids], device=device)
            caches = model.new_caches() if use_cache else None
            new: list[int] = []
            step_input = idx
            for _ in range(n_new):
                logits = model(step_input if use_cache else idx, caches=caches).logits[0, -1].float()
                nxt = _sample(logits, temperature, top_k, gen)
                new.append(nxt)
                tok = torch.tensor([[nxt]], device=device)
                idx = torch.cat([idx, tok], dim=1)
                step_input = tok
            outs.append(bytes(new).decode("utf-8", errors="replace"))
    finally:
        model.train(was_training)
    return outs


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.cpu() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
