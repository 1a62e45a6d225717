"""The demo's summaries: readable end lines and the cost of each run's traffic on common links."""

from __future__ import annotations

import json
from pathlib import Path

from moebit.cli.demo import LINKS, link_costs
from moebit.training.loop import summary_line


def test_summary_line_reads_like_a_sentence():
    line = summary_line({"kind": "end", "steps": 250, "val_loss": 1.9671, "n_params": 1_850_000,
                         "tokens_per_s": 4321.0, "bytes_sent": 123_400_000, "train_time": 61.2,
                         "frozen_at": 50, "nan_skipped": 0})
    assert line.startswith("moebit: finished: 250 steps, val loss 1.9671 nats/byte (2.838 bits/byte)")
    assert "123.4 MB sent per rank" in line and "variance frozen at step 50" in line
    assert "{" not in line  # no raw JSON


def test_link_costs_price_the_bytes_each_run_sent(tmp_path: Path):
    run = tmp_path / "adam"
    run.mkdir()
    recs = [{"kind": "start"}, {"kind": "end", "bytes_sent": 125_000_000}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    table = link_costs([run]).splitlines()
    assert table[0].split()[0] == "run" and len(LINKS) == 3
    assert table[1].split() == ["adam", "125.0", "10.0s", "1.0s", "0.1s"]  # 1 Gbit in 100M/1G/10G
