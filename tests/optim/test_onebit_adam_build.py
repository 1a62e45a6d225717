"""build_optimizer and the DeepSpeed-config mapping."""

from __future__ import annotations

import logging

import pytest
import torch

from moebit.optim import (
    OnebitAdam,
    OptimizerSettings,
    build_optimizer,
    optimizer_from_deepspeed_config,
    optimizer_names,
    register_optimizer,
)


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(3, 2).parameters())


def test_build_by_name() -> None:
    adam = build_optimizer("adam", _params(), lr=1e-3)
    assert type(adam) is torch.optim.Adam
    adamw = build_optimizer("adam", _params(), lr=1e-3, weight_decay=0.1)
    assert type(adamw) is torch.optim.AdamW
    ob = build_optimizer("onebit_adam", _params(), lr=2e-3, freeze_step=7, betas=(0.8, 0.99))
    assert isinstance(ob, OnebitAdam) and ob.freeze_step == 7
    assert ob.param_groups[0]["betas"] == (0.8, 0.99) and ob.param_groups[0]["lr"] == 2e-3
    assert build_optimizer("onebit_adam", _params(), lr=1e-3).freeze_step == "auto"
    # The training-loop contract.
    assert OnebitAdam.averages_gradients is True
    assert not getattr(adam, "averages_gradients", False)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; valid: adam, onebit_adam"):
        build_optimizer("sgd", _params(), lr=1e-3)


def test_registry_is_one_entry_to_extend() -> None:
    seen = {}

    def sgd(groups, settings: OptimizerSettings, **extra):
        seen.update(settings=settings, extra=extra)
        return torch.optim.SGD(groups, lr=settings.lr, weight_decay=settings.weight_decay,
                               **extra)

    register_optimizer("test_sgd", sgd)
    try:
        opt = build_optimizer("test_sgd", _params(), lr=0.1, weight_decay=0.01, momentum=0.5)
        assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.5
        assert seen["settings"] == OptimizerSettings(lr=0.1, weight_decay=0.01)
        assert seen["extra"] == {"momentum": 0.5}
        assert "test_sgd" in optimizer_names()
    finally:
        from moebit.optim import build

        build._REGISTRY.pop("test_sgd")


def test_torch_adam_keeps_and_survives_process_group_keys() -> None:
    lin = torch.nn.Linear(3, 2)
    groups = [
        {"params": [lin.weight], "process_group": None},
        {"params": [lin.bias], "process_group": None, "weight_decay": 0.0},
    ]
    opt = build_optimizer("adam", groups, lr=1e-2)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert all("process_group" in g for g in opt.param_groups)


def test_deepspeed_onebit_adam_mapping(caplog) -> None:
    cfg = {
        "train_batch_size": 8,
        "optimizer": {
            "type": "OneBitAdam",
            "params": {
                "lr": 4e-4,
                "betas": [0.9, 0.98],
                "eps": 1e-6,
                "weight_decay": 0.01,
                "freeze_step": 23,
                "cuda_aware": False,
                "comm_backend_name": "nccl",
            },
        },
    }
    with caplog.at_level(logging.INFO, logger="moebit.optim"):
        opt = optimizer_from_deepspeed_config(cfg, _params())
    assert isinstance(opt, OnebitAdam)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (4e-4, (0.9, 0.98), 1e-6, 0.01)
    assert opt.freeze_step == 23 and opt.bias_correction
    notes = [r.message for r in caplog.records]
    assert any("cuda_aware" in n and "not needed" in n for n in notes)
    assert any("comm_backend_name" in n and "not needed" in n for n in notes)


def test_deepspeed_defaults_and_other_types() -> None:
    opt = optimizer_from_deepspeed_config({"optimizer": {"type": "onebitadam"}}, _params())
    assert opt.freeze_step == 100000 and opt.param_groups[0]["lr"] == 1e-3
    auto = {"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": "auto"}}}
    assert optimizer_from_deepspeed_config(auto, _params()).freeze_step == "auto"
    nobc = {"optimizer": {"type": "OneBitAdam", "params": {"bias_correction": False}}}
    assert optimizer_from_deepspeed_config(nobc, _params()).bias_correction is False
    adam = {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.1}}}
    assert type(optimizer_from_deepspeed_config(adam, _params())) is torch.optim.AdamW
    l2 = {"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1, "adam_w_mode": False}}}
    assert type(optimizer_from_deepspeed_config(l2, _params())) is torch.optim.Adam
    adamw = {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}}
    assert type(optimizer_from_deepspeed_config(adamw, _params())) is torch.optim.AdamW


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({}, "no 'optimizer' section"),
        ({"optimizer": {"type": "Lion"}}, "unsupported DeepSpeed optimizer type 'Lion'"),
        (
            {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "frezee_step": 5}}},
            "unknown params .*frezee_step",
        ),
        ({"optimizer": {"type": "OneBitAdam", "param": {}}}, "unknown keys .*param"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}, "amsgrad"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"max_grad_norm": 1.0}}}, "clip"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"eps_inside_sqrt": True}}}, "eps"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 0}}}, "freeze_step"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"lr": -1}}}, "learning rate"),
    ],
)
def test_deepspeed_config_errors(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        optimizer_from_deepspeed_config(cfg, _params())
