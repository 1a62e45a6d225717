"""A random Mixtral-style Hugging Face folder for the sharding benchmark (nothing downloaded).

    python docs/scripts/mixtral_folder.py OUT [HIDDEN LAYERS EXPERTS]

Byte-level vocabulary (256 ids, no tokenizer needed), ``intermediate_size`` 3.5 x hidden,
top-2 of EXPERTS experts in every layer; saved with transformers' ``save_pretrained``.
"""

from __future__ import annotations

import sys

import torch
import transformers


def main(out: str, hidden: int = 256, layers: int = 4, experts: int = 8) -> None:
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=256, hidden_size=hidden, intermediate_size=int(3.5 * hidden),
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512,
        num_local_experts=experts, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
