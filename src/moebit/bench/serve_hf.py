"""``moebit bench serve --hf``: the server on a Hugging Face folder against two baselines.

The same weights and prompts go three ways:

- ``moebit serve HF_DIR`` (continuous batching, over HTTP, as in ``moebit bench serve``);
- static batching: ``moebit.inference.generate.generate_tokens`` on the folder loaded by
  ``moebit.hf.from_pretrained`` (what ``moebit generate HF_DIR --batch C`` runs);
- transformers' ``generate`` on the folder loaded by transformers itself, in batches of C,
  left-padded with an attention mask, greedy, each batch decoded to its longest request
  (``min_new_tokens`` too, so an end-of-text token cannot end a batch early), with the
  ``dynamic`` (default) or ``static`` KV cache (``--hf-cache``).

Both baselines count only the tokens each request asked for, as the server's figure does.
Without a folder (``--hf`` alone) transformers builds a random Mixtral of about the size
of ``moebit bench serve``'s synthetic model, with a byte-level BPE tokenizer trained on a
few KB of the Python standard library (nothing is downloaded).
"""

from __future__ import annotations

import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from moebit.bench.serve_load import pct
from moebit.inference.generate import generate_tokens
from moebit.models.tokenizer import HFTokenizer

MIXTRAL = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
           "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 1024}


def synthetic_hf_folder(folder: Path) -> Path:
    """A random Mixtral saved with ``save_pretrained``, plus a ``tokenizer.json``."""
    import transformers  # optional peer: only the --hf mode needs it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("mixtral", **MIXTRAL)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # routers start at zero: give them a spread, so experts differ
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:20000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=MIXTRAL["vocab_size"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return folder


def encode_jobs(folder: Path, jobs: list[tuple[str, int]]) -> list[list[int]]:
    """The prompts as the server encodes them (the folder's tokenizer, no special tokens)."""
    tok = HFTokenizer.from_folder(folder)
    return [tok.encode(p) or [0] for p, _ in jobs]


def load_transformers(folder: Path) -> Any:
    import transformers  # optional peer: only the --hf mode needs it

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def static_ids(model: Any, ids: list[list[int]], budgets: list[int], batch: int) -> dict[str, Any]:
    """Static batching on token ids (``generate_tokens``, greedy, batches in order)."""
    t0 = time.perf_counter()
    firsts = []
    for i in range(0, len(ids), batch):
        ts = time.perf_counter()
        res = generate_tokens(model, ids[i:i + batch], max(budgets[i:i + batch]),
                              temperature=0, batch_size=batch)
        firsts += [ts - t0 + res.prefill_s] * len(ids[i:i + batch])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": sum(budgets) / wall,
            "ttft_p50_ms": pct(firsts, 50), "ttft_p99_ms": pct(firsts, 99)}


@torch.no_grad()
def transformers_generate(model: Any, ids: list[list[int]], budgets: list[int], batch: int,
                          cache: str = "dynamic") -> dict[str, Any]:
    """transformers' ``generate``: batches of ``batch`` prompts, left-padded, greedy."""
    t0 = time.perf_counter()
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    for i in range(0, len(ids), batch):
        chunk, n = ids[i:i + batch], max(budgets[i:i + batch])
        width = max(len(p) for p in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, p in enumerate(chunk):
            input_ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                       min_new_tokens=n, pad_token_id=0, **extra)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": sum(budgets) / wall}
