"""Bytes on the wire per step and state bytes per rank of sharded training, by format.

Runs a few AdamW steps of moebit's GPT under ``shard_model`` on N gloo ranks for each
(rs_compress, ag_compress) pair and prints, per rank and step, the reduce-scatter and
all-gather bytes that ``moebit.comm.stats`` counted (kinds ``rs`` / ``ag``: algorithmic
volume sent) and the parameter + gradient + optimizer bytes this rank holds, next to a
whole replica's. Counts, not timings: they do not depend on the machine's load.

    PYTHONPATH=$PWD/src python docs/scripts/shard_bytes.py 4 128 4
    # arguments: ranks, d_model, n_layer
"""

from __future__ import annotations

import sys

import torch

from moebit.comm import stats
from moebit.models.gpt import GPT, GPTConfig
from moebit.testing import run_on_ranks
from moebit.training.shard_memory import state_bytes_per_rank
from moebit.training.sharding import ShardConfig, shard_model

MODES = [("none", "none"), ("bf16", "bf16"), ("int8", "int8"), ("int8", "none")]
STEPS = 3


def _model(d_model: int, n_layer: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=4, d_model=d_model, block_size=64))


def _held(model: torch.nn.Module, rank: int) -> tuple[int, dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats.reset()
    for step in range(STEPS):
        x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(rank * 100 + step))
        model(x[:, :-1], x[:, 1:]).loss.backward()
        opt.step()
        if step < STEPS - 1:
            opt.zero_grad()
    kinds = stats.snapshot().by_kind()
    per_step = {k: kinds[k].bytes_sent // STEPS for k in ("rs", "ag") if k in kinds}
    return state_bytes_per_rank(model, opt).total, per_step


def _body(rank: int, world: int, d_model: int, n_layer: int) -> list:
    rows = [("replica", "", *_held(_model(d_model, n_layer), rank))]
    for rs, ag in MODES:
        model = shard_model(_model(d_model, n_layer), ShardConfig("fsdp", rs_compress=rs,
                                                                  ag_compress=ag))
        rows.append((rs, ag, *_held(model, rank)))
    return rows


def main() -> None:
    world, d_model, n_layer = (int(a) for a in sys.argv[1:4])
    rows = run_on_ranks(_body, world, args=(d_model, n_layer), timeout=900)[0]
    print(f"world {world}, GPT d_model {d_model}, {n_layer} layers; rank 0, per step")
    print(f"{'rs':>8} {'ag':>6} {'state MB/rank':>14} {'rs MB':>8} {'ag MB':>8}")
    for rs, ag, held, per_step in rows:
        print(f"{rs:>8} {ag:>6} {held / 2**20:14.2f} {per_step.get('rs', 0) / 2**20:8.3f} "
              f"{per_step.get('ag', 0) / 2**20:8.3f}")


if __name__ == "__main__":
    main()
