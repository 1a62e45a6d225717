"""Rank bodies for the launcher tests, light enough to start in a second (no torch).

    python -m moebit.runs.runtime reliability.rank_behaviour BEHAVIOUR DIR

fail-all / fail-one: an error on every rank / on rank 1; crash / disk: rank 1 fails in
"model code" (RuntimeError) / on a full disk (OSError); sleep: wait to be stopped; slow:
steps of ~10-60 s spent in one C call that never returns to the interpreter, as a big matmul
does; finish: write the run's end record, then a few seconds of wrapping up; ignore: a
rank that ignores SIGTERM itself; stopped-while-recording: an error that receives SIGTERM
while the rank records it (as the agent stops rank 0 while it writes its peer-gone error).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from moebit.checkpoint import CheckpointError


class StoppedWhileDescribed(RuntimeError):
    """Sends its own process SIGTERM when described, then lets the handler run."""

    def __str__(self) -> str:
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the stop thread hands the signal to the main thread meanwhile
        return "Connection closed by peer"


def main(argv: list[str]) -> int:
    what, folder = argv[0], Path(argv[1])
    rank = int(os.environ["RANK"])
    (folder / f"rank-{rank}.pid").write_text(str(os.getpid()))
    if what == "fail-all":
        raise ValueError("bad key 'x' in f.json")
    if what == "fail-one" and rank == 1:
        raise CheckpointError(f"checkpoint file {folder}/rank-00001.pt is corrupted")
    if what == "crash" and rank == 1:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x32 and 16x32)")
    if what == "disk" and rank == 1:
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "step-2"))
    if what == "stopped-while-recording":
        raise StoppedWhileDescribed()
    if what == "slow":
        (folder / f"rank-{rank}.stepping").write_text("")
        while True:  # one C call of seconds per "step": no signal handler runs inside it
            hashlib.pbkdf2_hmac("sha256", b"moebit", b"salt", 30_000_000)
    if what == "ignore":  # a module that handles SIGTERM itself (as moebit serve's ranks do)
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (folder / f"rank-{rank}.ignoring").write_text("")
        time.sleep(5)  # longer than the stop grace
        (folder / f"rank-{rank}.survived").write_text("")
        return 0
    if what == "finish":
        from moebit.runs import runtime

        if rank == 0:
            with open(folder / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"kind": "end", "steps": 1, "wall": time.time()}) + "\n")
        runtime.work_done()
        (folder / f"rank-{rank}.done").write_text("")
        time.sleep(3)  # plots, trackers: the last writes of a finished run
        return 0
    time.sleep(300)  # until stopped or killed
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
