"""A Mixtral-style moebit model -> a GGUF file llama.cpp runs (F32, Q8_0 or Q4_0).

Why our own writer rather than llama.cpp's ``convert_hf_to_gguf.py``: that script ships
only inside the llama-cpp-python source tarball (not in any installed package), needs a
tokenizer the benchmark's byte-vocabulary folders do not have, and has no Q4_0 output.
This writes the very tensors moebit runs (read from the loaded ``HFDecoder``, either
expert layout of the folder already resolved) with the ``gguf`` package's ``GGUFWriter``
and its reference quantizers, under llama.cpp's names and conventions for the ``llama``
architecture, which is what the script writes for Mixtral:

- q_proj / k_proj rows permuted per head (``permute``): HF rotates halves of a head,
  llama.cpp's ``llama`` graph rotates interleaved pairs;
- experts stacked [E, F, d] as ``ffn_gate_exps`` / ``ffn_up_exps`` and [E, d, F] as
  ``ffn_down_exps``; the router ``ffn_gate_inp`` and every norm stay F32 (as the script
  keeps them), every other matrix takes the file's type;
- a byte vocabulary: GPT-2's byte-level BPE alphabet with no merges, so token i is byte i
  as in moebit's byte-level folders, for token ids and text alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

QTYPES = ("F32", "Q8_0", "Q4_0")


def byte_level_alphabet() -> list[str]:
    """The 256 characters GPT-2's byte-level BPE writes for bytes 0..255, in byte order:
    printable bytes stand for themselves, the others, in order, for U+0100 onwards."""
    chars, unprintable = [], 0
    for b in range(256):
        if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + unprintable))
            unprintable += 1
    return chars


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q/k projection from HF's half-split RoPE order to llama.cpp's pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def check_mixtral_style(model: Any) -> None:
    """Only what this writer maps: pre-norm blocks, every layer MoE, SwiGLU, no biases,
    no q/k norm, no clipping, default RoPE, untied head, 256-token vocabulary."""
    c = model.config
    problems = [msg for bad, msg in (
        (c.post_norm, "post-norm blocks"), (c.qk_norm != "none", "q/k norms"),
        (c.clip_qkv is not None, "clip_qkv"), (c.attention_bias, "attention biases"),
        (len(c.moe_layers) != c.num_layers, "dense layers"),
        (c.rope_type != "default", f"rope_type {c.rope_type!r}"),
        (c.tie_word_embeddings, "a tied head"), (c.vocab_size != 256, f"vocab {c.vocab_size}"),
        (c.scoring_func != "softmax" or not c.norm_topk_prob, "a router other than "
         "softmax-then-renormalised top-k"),
        (c.shared_expert_intermediate_size > 0, "a shared expert"),
    ) if bad]
    if problems:
        raise ValueError(f"GGUF export handles Mixtral-style byte-vocabulary models only; "
                         f"this one has {', '.join(problems)}")


def _tensors(model: Any) -> list[tuple[str, torch.Tensor, bool]]:
    """(GGUF name, float32 tensor, whether it takes the file's type) in file order."""
    c = model.config
    out = [("token_embd.weight", model.wte.weight, True)]
    for i, blk in enumerate(model.blocks):
        a, moe = blk.self_attn, blk.mlp
        w_up, _, w_down, _ = moe.experts.projections()  # [E, 2F, d] gate rows first, [E, d, F]
        f = w_down.shape[-1]
        out += [
            (f"blk.{i}.attn_norm.weight", blk.input_layernorm.weight, False),
            (f"blk.{i}.attn_q.weight", permute(a.q_proj.weight, c.num_heads), True),
            (f"blk.{i}.attn_k.weight", permute(a.k_proj.weight, c.num_kv_heads), True),
            (f"blk.{i}.attn_v.weight", a.v_proj.weight, True),
            (f"blk.{i}.attn_output.weight", a.o_proj.weight, True),
            (f"blk.{i}.ffn_norm.weight", blk.post_attention_layernorm.weight, False),
            (f"blk.{i}.ffn_gate_inp.weight", moe.gate.router.weight, False),
            (f"blk.{i}.ffn_gate_exps.weight", w_up[:, :f], True),
            (f"blk.{i}.ffn_up_exps.weight", w_up[:, f:], True),
            (f"blk.{i}.ffn_down_exps.weight", w_down, True),
        ]
    out += [("output_norm.weight", model.norm.weight, False),
            ("output.weight", model.lm_head.weight, True)]
    return out


def _metadata(w: Any, model: Any, ftype: int) -> None:
    import gguf

    c = model.config
    w.add_name("moebit-bench")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.moe_intermediate_size or c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(ftype)
    # GPT-2's byte-level BPE with no merges: llama.cpp then reads any text as its bytes
    # (token i = byte i, moebit's byte vocabulary), where a SentencePiece vocabulary of
    # byte tokens would first turn each space into "\u2581" and that into three bytes
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_level_alphabet())
    w.add_token_types([gguf.TokenType.NORMAL] * 256)
    # llama.cpp refuses a BPE vocabulary without merges, and the writer drops an empty
    # list: one merge of two ASCII bytes, whose result is no token, so that llama.cpp
    # falls back to the two bytes' own tokens and every text still reads as its bytes
    w.add_token_merges(["~ ~"])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


def write_gguf(model: Any, path: str | Path, qtype: str = "F32") -> Path:
    """Write ``model`` (a loaded Mixtral-style ``HFDecoder``) to ``path`` as ``qtype``."""
    import gguf  # the optional ``llamacpp`` extra

    if qtype not in QTYPES:
        raise ValueError(f"GGUF type must be one of {QTYPES}, got {qtype!r}")
    check_mixtral_style(model)
    gq = getattr(gguf.GGMLQuantizationType, qtype)
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype]
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    _metadata(w, model, int(ftype))
    with torch.no_grad():
        for name, t, quantized in _tensors(model):
            data = t.detach().float().contiguous().numpy()
            if quantized and qtype != "F32":
                if data.shape[-1] % 32:
                    raise ValueError(f"GGUF {qtype}: {name} has rows of {data.shape[-1]} "
                                     f"weights, not a multiple of 32 (GGML's block)")
                w.add_tensor(name, gguf.quants.quantize(data, gq), raw_dtype=gq)
            else:
                w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    w.close()
    return path
