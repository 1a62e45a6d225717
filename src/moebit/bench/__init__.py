"""Benchmarks: communication, MoE layers, training, inference."""
