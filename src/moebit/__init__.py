"""moebit: 1-bit compressed optimizers and Mixture-of-Experts on plain torch.distributed."""

__version__ = "0.1.0"
