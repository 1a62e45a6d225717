"""1-bit optimizers under a DDP-wrapped model (the accelerate / Trainer setting), 2 gloo ranks:
the loss follows the same run under moebit's own exchange (no DDP)."""

from __future__ import annotations

import copy

import pytest
import torch

from moebit.testing import run_on_ranks

TINY = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}


def _losses(rank: int, world: int, name: str) -> dict[str, list[float]]:
    from torch.nn.parallel import DistributedDataParallel

    from moebit.hf import HFDecoder, HFDecoderConfig
    from moebit.hf.ddp import onebit_optimizer_for_ddp
    from moebit.optim import build_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = HFDecoder(HFDecoderConfig.from_hf(TINY)).train()
    wrapped = DistributedDataParallel(copy.deepcopy(plain))
    kw = {"lr": 3e-3, "freeze_step": 3}
    opts = {"moebit": build_optimizer(name, [{"params": list(plain.parameters())}], **kw),
            "ddp": onebit_optimizer_for_ddp(wrapped, name, **kw)}
    models = {"moebit": plain, "ddp": wrapped}
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own (fixed) batch
    ids = torch.randint(0, 64, (2, 17), generator=gen)
    out: dict[str, list[float]] = {"moebit": [], "ddp": []}
    for _ in range(8):
        for k, m in models.items():
            o = m(ids[:, :-1], ids[:, 1:])
            (o.loss + o.aux_loss).backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            out[k].append(float(o.loss.detach()))
    return out


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
def test_ddp_hook_optimizer_matches_moebit_exchange(name):
    for res in run_on_ranks(_losses, world=2, args=(name,), timeout=240):
        assert res["ddp"][0] == res["moebit"][0]
        # past the freeze both exchange 1-bit momentum; only summation order differs
        torch.testing.assert_close(torch.tensor(res["ddp"]), torch.tensor(res["moebit"]),
                                   atol=1e-4, rtol=0)
        assert res["moebit"][-1] < res["moebit"][0]  # it trains


@pytest.mark.slow
def test_torchrun_two_gloo_ranks(tmp_path):
    """The same check launched for real by torchrun (as accelerate / Trainer runs are)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("ddp_onebit_torchrun.py")
    out = tmp_path / "losses.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--standalone", str(script), str(out)],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["frozen_at"] is not None  # the run went past the variance freeze
    for losses in res["ranks"]:
        torch.testing.assert_close(torch.tensor(losses["ddp"]), torch.tensor(losses["moebit"]),
                                   atol=1e-4, rtol=0)
        assert min(losses["ddp"][1:]) < losses["ddp"][0]  # it trains
