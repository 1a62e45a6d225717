"""Step-level A/B of decoding: an older moebit (imported as ``moebit_base``) against this one.

On a loaded machine whole benchmark processes minutes apart meet different loads; here
the two versions decode the same batch with the same weights in one process, their
prefills and decode steps alternating one by one (order flipped every step), so each
pair of steps meets the same load. Wall and CPU (thread) time per step are reported as
medians, minima and the median of the paired new/base ratios; greedy tokens must agree.

    git worktree add /tmp/fwd-base 8ca6317                     # the commit before issue 14
    mkdir -p /tmp/fwd-ab && cp -r /tmp/fwd-base/src/moebit /tmp/fwd-ab/moebit_base
    find /tmp/fwd-ab/moebit_base -name '*.py' -exec sed -i -E \\
        's/\\bfrom moebit\\./from moebit_base./g; s/\\bimport moebit\\./import moebit_base./g; \\
         s/\\bfrom moebit import/from moebit_base import/g' {} +
    PYTHONPATH=/tmp/fwd-ab:$PWD/src python docs/scripts/ab_decode_steps.py 128 4 10 16
    # arguments: d_model, n_head, reps (batches per configuration), new tokens per row
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import moebit_base.inference as old_gen
import moebit_base.models.gpt as old_gpt
import moebit_base.quantize as old_q
import torch

import moebit.inference.generate as new_gen
import moebit.models.gpt as new_gpt
import moebit.inference.quantize as new_q

TEXT = b"def main(argv):\n    import os, sys\n    for name in sorted(os.listdir('.')):\n"


def run_of(gen, model, batch: int, lens: list[int], new_tokens: int):  # type: ignore[no-untyped-def]
    prompts = [list((TEXT * 4)[i % 7: i % 7 + lens[i % len(lens)]]) for i in range(batch)]
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    return gen._BatchRun(model, prompts, [new_tokens] * batch, gens, None)


def timed(run) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    c0, t0 = time.thread_time(), time.perf_counter()
    run.step(0.0, None)
    return time.perf_counter() - t0, time.thread_time() - c0


def main() -> None:
    d, heads, reps, new_tokens = (int(a) for a in sys.argv[1:5])
    torch.set_num_threads(1)
    kw = dict(n_layer=4, n_head=heads, d_model=d, block_size=128, num_experts=64, moe_every=2,
              moe={"num_experts_per_tok": 1})
    torch.manual_seed(0)
    new = new_gpt.GPT(new_gpt.GPTConfig(**kw)).eval()
    old = old_gpt.GPT(old_gpt.GPTConfig(**kw)).eval()
    old.load_state_dict(new.state_dict())
    o8, n8 = copy.deepcopy(old), copy.deepcopy(new)
    old_q.quantize_experts_(o8)
    new_q.quantize_experts_(n8)
    print("| d_model | experts | batch | prompts | steps | wall base ms (median) | wall new ms "
          "(median) | wall new/base (median of pairs) | wall base min | wall new min | cpu base "
          "ms (median) | cpu new ms (median) | cpu new/base (median of pairs) | cpu base min | "
          "cpu new min | prefill wall new/base | same tokens |")
    print("|" + "---|" * 17)
    with torch.no_grad():
        for fmt, (mo, mn) in (("fp32", (old, new)), ("int8", (o8, n8))):
            for batch, lens in ((1, [16]), (32, [16]), (32, [16, 9, 13, 5])):
                pairs, pre, same = [], [], True
                for r in range(reps):
                    a = run_of(old_gen, mo, batch, lens, new_tokens)
                    b = run_of(new_gen, mn, batch, lens, new_tokens)
                    for s in range(new_tokens):
                        if (r + s) % 2 == 0:
                            ta, tb = timed(a), timed(b)
                        else:
                            tb, ta = timed(b), timed(a)
                        (pre if s == 0 else pairs).append((ta, tb))
                    same = same and a.new == b.new
                wa, wb = [p[0][0] * 1e3 for p in pairs], [p[1][0] * 1e3 for p in pairs]
                ca, cb = [p[0][1] * 1e3 for p in pairs], [p[1][1] * 1e3 for p in pairs]
                wr = statistics.median(y[0] / x[0] for x, y in pairs)
                cr = statistics.median(y[1] / max(x[1], 1e-9) for x, y in pairs)
                pr = statistics.median(y[0] / x[0] for x, y in pre)
                kind = "equal" if len(lens) == 1 else "padded"
                print(f"| {d} | {fmt} | {batch} | {kind} | {len(pairs)} | {statistics.median(wa):.2f} | "
                      f"{statistics.median(wb):.2f} | {wr:.3f} | {min(wa):.2f} | {min(wb):.2f} | "
                      f"{statistics.median(ca):.2f} | {statistics.median(cb):.2f} | {cr:.3f} | "
                      f"{min(ca):.2f} | {min(cb):.2f} | {pr:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
