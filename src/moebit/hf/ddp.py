"""moebit's 1-bit optimizers under someone else's DDP (accelerate, transformers' Trainer).

Those stacks wrap the model in ``DistributedDataParallel`` themselves, and DDP then
allreduces every gradient in full: a 1-bit optimizer on top would exchange its
compressed momentum *and* DDP the exact gradients, paying twice. The fix is a DDP
communication hook that hands the exchange over to the optimizer:

- ``onebit_adam``: DDP averages the exact gradients during the warm-up (overlapped with
  the backward pass, as DDP does best), and stops communicating at the variance freeze
  (``FreezableAllreduceState``, frozen by the optimizer itself); the optimizer then
  exchanges 1-bit momentum.
- ``zero_one_adam`` / ``onebit_lamb``: these decide when to communicate themselves, so
  DDP never sends anything (the hook is frozen from the start).

    ddp = accelerator.prepare(model)                 # or DistributedDataParallel(model)
    opt = onebit_optimizer_for_ddp(ddp, "onebit_adam", lr=1e-4, freeze_step=100)
    ...  loss.backward(); opt.step(); opt.zero_grad()  # as with any optimizer

Register before the first backward pass (DDP accepts one hook, once).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from moebit.comm import FreezableAllreduceState, freezable_allreduce_hook
from moebit.optim import build_optimizer

DDP_OPTIMIZERS = ("onebit_adam", "zero_one_adam", "onebit_lamb")


def onebit_optimizer_for_ddp(ddp_model: nn.Module, name: str = "onebit_adam", *,
                             lr: float, **settings: Any) -> Optimizer:
    """Register moebit's freezable hook on ``ddp_model`` and return the optimizer ``name``
    over its parameters, set up so that gradients never cross the network twice.

    ``settings``: betas, eps, weight_decay, freeze_step and the optimizer's own options
    (as ``moebit.optim.build_optimizer`` takes them).
    """
    if name not in DDP_OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: onebit_optimizer_for_ddp serves {DDP_OPTIMIZERS} "
                         "(an exact optimizer needs no hook: use it as it is)")
    if not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError(f"{type(ddp_model).__name__} is not a DistributedDataParallel model")
    state = FreezableAllreduceState(getattr(ddp_model, "process_group", None))
    groups = [{"params": [p for p in ddp_model.parameters() if p.requires_grad]}]
    if name == "onebit_adam":
        opt = build_optimizer(name, groups, lr=lr, grads_averaged_externally=True,
                              ddp_hook_state=state, **settings)
    else:
        state.freeze()  # the optimizer communicates on its own schedule
        opt = build_optimizer(name, groups, lr=lr, **settings)
    ddp_model.register_comm_hook(state, freezable_allreduce_hook)
    return opt
