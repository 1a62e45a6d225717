"""Sparse upcycling: dense models become MoE models."""
