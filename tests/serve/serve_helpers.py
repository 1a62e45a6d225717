"""Small models and run folders for the serving tests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from moebit.inference.sampling import SamplingParams
from moebit.models.gpt import GPT
from moebit.serve.engine import Engine, Event, Request
from moebit.testing import free_port
from moebit.training.config import build

import toys

SRC = str(Path(__file__).resolve().parents[2] / "src")

TINY = {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 64}
MOE = {**TINY, "num_experts": 4, "moe_every": 1}


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(build({**TINY, **overrides}).model_config()).eval()


def save_run(run: Path, **overrides) -> GPT:
    """A run folder holding one checkpoint of a random tiny model (as moebit train saves it)."""
    return toys.save_run(run, {**TINY, **overrides})


class Collect:
    """A request's events gathered on the engine thread."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)


def request(rid: str, prompt: bytes, **params) -> tuple[Request, Collect]:
    c = Collect()
    return Request(rid, list(prompt), SamplingParams(**params), c), c


def run_engine(engine: Engine, reqs: list[Request]) -> None:
    for r in reqs:
        engine.submit(r)
    while engine.busy():
        engine.step()


class Server:
    """``moebit serve`` in a subprocess on a free 127.0.0.1 port, killed on exit."""

    def __init__(self, run: Path, *flags: str, start_timeout: float = 90.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moebit.cli", "serve", str(run), "--port", str(self.port),
             "--threads", "1", *flags], env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("server did not start in time")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
