"""``evaluate``: the loss it reports, and the train/eval mode it hands back."""

import pytest
import torch

from moebit.models.gpt import GPT, GPTConfig
from moebit.training.evaluation import evaluate


def _model_and_batches() -> tuple[GPT, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=16, dropout=0.5))
    data = torch.randint(0, 256, (5, 17))
    return model, [(data[:3, :-1], data[:3, 1:]), (data[3:, :-1], data[3:, 1:])]


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_restores_the_mode_and_runs_in_eval_mode(training: bool) -> None:
    model, batches = _model_and_batches()
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    model.train(training)
    v = evaluate(model, batches, "fp32", torch.device("cpu"))
    assert model.training is training
    assert all(m.training is training for m in model.modules())
    assert seen == [False, False]  # dropout off while evaluating, whatever the mode before
    model.eval()
    with torch.no_grad():
        want = sum(float(model(x, y).loss) * len(x) for x, y in batches) / 5
    assert v == pytest.approx(want, rel=1e-6)


def test_evaluate_restores_the_mode_when_the_forward_fails() -> None:
    model, batches = _model_and_batches()

    def fail(m, args):  # type: ignore[no-untyped-def]
        raise RuntimeError("forward failed")

    model.register_forward_pre_hook(fail)
    model.train()
    with pytest.raises(RuntimeError, match="forward failed"):
        evaluate(model, batches, "fp32", torch.device("cpu"))
    assert model.training


def test_evaluate_without_batches_is_an_error() -> None:
    model, _ = _model_and_batches()
    with pytest.raises(ValueError, match="no validation batches"):
        evaluate(model, [], "fp32", torch.device("cpu"))
