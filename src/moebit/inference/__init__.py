"""Decoding: loading a trained model, KV-cache generation, sampling, int8 experts."""
