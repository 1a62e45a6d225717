"""Hugging Face interop, the public face: MoE checkpoints in and out, 1-bit optimizers
under transformers' Trainer or accelerate.

    from moebit.hf import from_pretrained, save_pretrained
    model = from_pretrained("path/to/mixtral")                 # a CausalLM
    model = from_pretrained(path, ep_size=2, rank=r)           # this rank reads its experts only
    save_pretrained(model, "out/")                             # transformers loads "out/"

The implementation lives in ``moebit.models.hf`` (the decoder, its config mapping and
weights); ``moebit.hf.ddp`` hands DDP's gradient exchange to a 1-bit optimizer.
"""

from moebit.models.hf import (
    FAMILIES,
    HFDecoder,
    HFDecoderConfig,
    LoadReport,
    build_empty,
    from_pretrained,
    is_hf_folder,
    load_hf_weights,
    read_config,
    save_pretrained,
)

__all__ = ["FAMILIES", "HFDecoder", "HFDecoderConfig", "LoadReport", "build_empty",
           "from_pretrained", "is_hf_folder", "load_hf_weights", "read_config", "save_pretrained"]
