"""Real `moebit` launches for fault tests: start one with a tag, find its ranks through
/proc, kill one after the first checkpoint, and start two launchers as two nodes.

One copy of these loops, so that every restart test waits, finds and kills the same way
(and a fix to the /proc reading reaches all of them)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

TRAIN_MODULE = "moebit.training.loop"  # what a `moebit train` rank runs
DISTILL_MODULE = "moebit.distill.run"  # what a `moebit distill` rank runs


def tagged_rank_pids(tag: str, module: str = TRAIN_MODULE) -> dict[int, int]:
    """{global rank: pid} of the ranks running ``module`` with MOEBIT_TEST_TAG=tag: the tag
    tells this test's ranks from those of tests running next to it."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() not in cmd:
            continue
        vars_ = dict(e.split(b"=", 1) for e in env if b"=" in e)
        if vars_.get(b"MOEBIT_TEST_TAG") == tag.encode() and b"RANK" in vars_:
            found[int(vars_[b"RANK"])] = int(entry)
    return found


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (a launcher's ranks), read from /proc/*/stat."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def restart_args(corpus: Path, run: Path, steps: int, save_every: int,
                 max_restarts: int = 1) -> list[str]:
    """`moebit train` flags of a 2-rank run of a 1-layer model, long enough (``steps``)
    for a kill after its first checkpoint to land mid-run."""
    return ["--nproc", "2", "--data", str(corpus), "--n-layer", "1", "--n-head", "2",
            "--d-model", "32", "--block-size", "32", "--batch-size", "4", "--steps", str(steps),
            "--save-every", str(save_every), "--eval-every", str(steps), "--eval-batches", "1",
            "--samples", "0", "--dtype", "fp32", "--log-every", "5",
            "--max-restarts", str(max_restarts), "--run-dir", str(run)]


def wait_for_checkpoint(proc: subprocess.Popen, run: Path, timeout: float = 180) -> None:
    """Block until RUN has a checkpoint manifest; kills the launcher and fails with its
    output if it ends first or none comes within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not list((run / "checkpoints").glob("step-*/manifest.json")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no checkpoint: " + proc.communicate()[0][-3000:])
        time.sleep(0.1)


@dataclass
class Launch:
    """A `moebit <command>` launcher in its own session, and the tag its ranks inherit."""

    proc: subprocess.Popen
    tag: str
    run: Path
    module: str = TRAIN_MODULE

    def rank_pids(self) -> dict[int, int]:
        return tagged_rank_pids(self.tag, self.module)

    def stop(self) -> None:
        """Kill the launcher's whole session if it still runs (a test's `finally`)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def start(command: str, args: list[str], run: Path, module: str = TRAIN_MODULE) -> Launch:
    """``python -m moebit.cli <command> *args`` with a fresh tag, output in one pipe."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "moebit.cli", command, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", MOEBIT_TEST_TAG=tag),
                            start_new_session=True)
    return Launch(proc, tag, run, module)


def kill_rank_after_first_checkpoint(launch: Launch, rank: int, timeout: float = 120) -> float:
    """SIGKILL ``rank`` once a checkpoint's manifest exists; the time of the kill. Fails
    (with the run's output) if the run ends first or no checkpoint comes within timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launch.proc.poll() is not None:
            raise AssertionError("run ended before the fault: " + launch.proc.stdout.read()[-2000:])
        if list((launch.run / "checkpoints").glob("step-*/manifest.json")):
            pids = launch.rank_pids()
            if rank in pids:
                os.kill(pids[rank], signal.SIGKILL)
                return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint appeared within {timeout:g} s")


def restart_after_a_kill(launch: Launch, timeout: float, wait: float = 120) -> list[dict]:
    """Kill rank 1 after the first checkpoint, let ``--max-restarts`` finish the run, and
    return its metrics records; asserts the launcher exits 0."""
    try:
        kill_rank_after_first_checkpoint(launch, rank=1, timeout=wait)
        out = launch.proc.communicate(timeout=timeout)[0]
    finally:
        launch.stop()
    assert launch.proc.returncode == 0, out[-3000:]
    return read_records(launch.run)


def read_records(run: Path) -> list[dict]:
    """The records of RUN/metrics.jsonl, in order."""
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def run_two_nodes(common: list[str], run_dir: Path, port: int, timeout: float,
                  bind_wait: float = 60) -> list[str]:
    """`moebit train *common` as node 0 and node 1 (run folders RUN_DIR/node0 and node1),
    their outputs; asserts both exit 0. Node 0 starts first and binds the rendezvous port
    (on one machine either launcher could host the store; on a cluster node 1 is
    elsewhere), node 1 once the port answers."""

    def launch(i: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "moebit.cli", "train", *common, "--node-rank", str(i),
             "--run-dir", str(run_dir / f"node{i}")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))

    procs = [launch(0)]
    deadline = time.monotonic() + bind_wait
    while time.monotonic() < deadline and procs[0].poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    procs.append(launch(1))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs
