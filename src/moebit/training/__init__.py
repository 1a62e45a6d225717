"""The training loop and what it needs: config, data, hooks, meters, gradients, evaluation, run state."""
