"""Mixture-of-Students pieces on one process: the KD loss, layer choice, init, config checks."""

import math

import pytest
import torch

from moebit.distill.run import (
    DistillConfig,
    DistillError,
    check_compatible,
    choose_layers,
    init_student_,
    kd_loss,
    student_config,
    student_train_config,
)
from moebit.models.gpt import GPT, GPTConfig
from moebit.training.config import build


def _hand_kd(s: list[list[float]], t: list[list[float]], T: float) -> float:
    """T^2 * mean over rows of sum_v p_t(v) * (log p_t(v) - log p_s(v)), in plain Python."""
    def log_softmax(row: list[float]) -> list[float]:
        z = [v / T for v in row]
        m = max(z)
        lse = m + math.log(sum(math.exp(v - m) for v in z))
        return [v - lse for v in z]

    total = 0.0
    for srow, trow in zip(s, t, strict=True):
        ls, lt = log_softmax(srow), log_softmax(trow)
        total += sum(math.exp(b) * (b - a) for a, b in zip(ls, lt, strict=True))
    return T * T * total / len(s)


@pytest.mark.parametrize("T", [1.0, 2.0, 0.5])
def test_kd_loss_equals_hand_computation(T: float):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, generator=g) * 3
    t = torch.randn(2, 3, 5, generator=g) * 3
    want = _hand_kd(s.reshape(6, 5).tolist(), t.reshape(6, 5).tolist(), T)
    got = kd_loss(s, t, T)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert float(got) == pytest.approx(want, rel=1e-5)
    # one row worked by hand: p_t = (1/2, 1/2), p_s = (1/4, 3/4)
    s1 = torch.log(torch.tensor([[0.25, 0.75]]))
    t1 = torch.log(torch.tensor([[0.5, 0.5]]))
    by_hand = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(kd_loss(s1, t1, 1.0)) == pytest.approx(by_hand, rel=1e-6)


def test_kd_loss_is_zero_for_equal_logits_and_has_gradient():
    x = torch.randn(4, 7, 256)
    assert float(kd_loss(x, x.clone(), 1.0)) == pytest.approx(0.0, abs=1e-6)
    s = torch.randn(4, 7, 256, requires_grad=True)
    kd_loss(s, x, 2.0).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_kd_loss_mismatched_vocabulary_is_a_clear_error():
    with pytest.raises(DistillError, match="vocabularies"):
        kd_loss(torch.randn(2, 4, 256), torch.randn(2, 4, 128), 1.0)


def test_choose_layers_keeps_kinds_first_last_and_pyramid():
    t = GPTConfig(n_layer=8, d_model=32, n_head=2, num_experts=[4, 4, 4, 8])
    assert choose_layers(t, 8) == list(range(8))
    assert choose_layers(t, 6) == [0, 1, 2, 5, 6, 7]  # a middle (MoE, dense) pair dropped
    assert choose_layers(t, 7) == [0, 1, 2, 3, 4, 5, 6]  # odd depth ends on a dense block
    s = student_config(t, [0, 1, 2, 5, 6, 7])
    assert s.n_layer == 6 and s.num_experts == [4, 4, 8]
    dense = GPTConfig(n_layer=8, d_model=32, n_head=2)
    keep = choose_layers(dense, 5)
    assert keep[0] == 0 and keep[-1] == 7 and len(keep) == 5
    with pytest.raises(DistillError, match="student-layers"):
        choose_layers(t, 9)


def test_bad_keep_layers_and_mismatched_shapes_are_clear_errors():
    t = GPTConfig(n_layer=4, d_model=32, n_head=2, num_experts=[2, 4])
    with pytest.raises(DistillError, match="student block 1 is an MoE block"):
        student_config(t, [0, 2])
    with pytest.raises(DistillError, match="strictly increasing"):
        student_config(t, [3, 0])
    with pytest.raises(DistillError, match="do not exist"):
        student_config(t, [0, 9])
    good = student_config(t, [0, 3])
    for key, value in (("vocab_size", 128), ("d_model", 64), ("block_size", 64)):
        other = GPTConfig(**{**good.to_dict(), key: value})
        with pytest.raises(DistillError, match=f"differ in {key}"):
            check_compatible(t, other, [0, 3])
    wrong_experts = GPTConfig(**{**good.to_dict(), "num_experts": [2]})
    with pytest.raises(DistillError, match="has 2 experts but teacher block 3"):
        check_compatible(t, wrong_experts, [0, 3])


def test_init_copies_the_kept_blocks():
    torch.manual_seed(0)
    t_cfg = GPTConfig(n_layer=4, d_model=32, n_head=2, block_size=16, num_experts=[2, 4],
                      moe={"residual": True})
    teacher = GPT(t_cfg)
    keep = choose_layers(t_cfg, 2)
    assert keep == [0, 3]
    student = GPT(student_config(t_cfg, keep))
    init_student_(student, teacher, keep)
    t_sd, s_sd = teacher.state_dict(), student.state_dict()
    for name, v in s_sd.items():
        src = name
        if name.startswith("blocks.1."):
            src = "blocks.3." + name[len("blocks.1."):]
        assert torch.equal(v, t_sd[src]), name
    # the student is not the teacher: dropping blocks changes its outputs
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert not torch.allclose(student(x).logits, teacher(x).logits)
    # a student of another width cannot be initialised from it
    narrow = GPT(GPTConfig(n_layer=2, d_model=16, n_head=2, block_size=16, num_experts=[4],
                           moe={"residual": True}))
    with pytest.raises(DistillError, match="shape"):
        init_student_(narrow, teacher, keep)


def test_student_train_config_and_stop_step():
    teacher = build({"n_layer": 4, "d_model": 32, "n_head": 2, "num_experts": [2, 4],
                     "moe_residual": True, "steps": 100, "lr": 3e-3})
    d = DistillConfig(teacher="unused", student_layers=2, kd_stop_fraction=0.3).validate()
    cfg, keep = student_train_config(teacher, d, {"steps": 40})
    assert keep == [0, 3] and cfg.model.n_layer == 2 and cfg.model.num_experts == [4]
    assert cfg.moe.residual and cfg.steps == 40 and cfg.lr == 3e-3
    assert d.kd_steps(40) == 12 and d.kd_steps(0) == 0
    assert DistillConfig(teacher="x", student_layers=2, no_kd=True).kd_steps(40) == 0
    with pytest.raises(DistillError, match="--d-model cannot be set"):
        student_train_config(teacher, d, {"d_model": 64})
    with pytest.raises(DistillError, match="kd-stop-fraction"):
        DistillConfig(teacher="x", student_layers=2, kd_stop_fraction=1.5).validate()
