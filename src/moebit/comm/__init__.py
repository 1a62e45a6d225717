"""Compressed collectives over any torch.distributed process group."""
