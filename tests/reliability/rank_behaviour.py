"""Rank bodies for the launcher tests, light enough to start in a second (no torch).

    python -m moebit.runs.runtime reliability.rank_behaviour fail-all|fail-one|sleep DIR
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from moebit.checkpoint import CheckpointError


def main(argv: list[str]) -> int:
    what, folder = argv[0], Path(argv[1])
    rank = int(os.environ["RANK"])
    (folder / f"rank-{rank}.pid").write_text(str(os.getpid()))
    if what == "fail-all":
        raise ValueError("bad key 'x' in f.json")
    if what == "fail-one" and rank == 1:
        raise CheckpointError(f"checkpoint file {folder}/rank-00001.pt is corrupted")
    time.sleep(300)  # until stopped or killed
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
