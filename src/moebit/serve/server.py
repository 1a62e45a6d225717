"""Running the server: rank 0's HTTP server and engine thread, the other ranks' lockstep.

    code = serve_main(model, ByteTokenizer(), "runs/a", host="127.0.0.1", port=8000)

Rank 0: uvicorn serves the app on the main thread (it owns SIGTERM/SIGINT: stop
accepting, finish the responses in flight), the engine steps on a thread; once uvicorn
has drained, the engine stops and the other ranks are told to stop. Exit code 0, or 1
when the engine failed (a dead rank: its collectives raise after the group's timeout or
at once on a closed connection, every request gets a 503, and the server stops).

Other ranks (expert parallel): ``follow`` receives each step's number of forwards from
rank 0 and runs that many forwards of an empty batch, serving their experts.

The port is bound before the engine starts (``bind``): a port in use is one line naming
it and exit code ``PORT_IN_USE`` (2, as for any bad flag), and the URL is printed only
once the socket is listening.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import uvicorn

from moebit.inference.generate import dropless, idle_forward
from moebit.models.interface import CausalLM
from moebit.models.tokenizer import Tokenizer
from moebit.serve.api import create_app
from moebit.serve.engine import Engine
from moebit.serve.metrics import Metrics


def broadcast_step(n: int) -> None:
    """Rank 0: tell every rank how many forwards this step runs (0 idle, -1 stop)."""
    dist.broadcast(torch.tensor([n], dtype=torch.long), src=0)


PORT_IN_USE = 2  # the exit code when --port cannot be bound (docs/serving.md)


class PortInUse(OSError):
    """The host/port cannot be bound (taken, or not an address of this machine)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or PortInUse with one line naming the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise PortInUse(f"cannot listen on {host}:{port} (port {port}): "
                        f"{e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def follow(model: CausalLM) -> int:
    """A rank other than 0: step in lockstep with rank 0 until it says stop."""
    # rank 0 drains on SIGTERM/SIGINT and then tells this rank to stop; dying first would
    # fail it (a Ctrl-C in a terminal reaches every rank of the process group)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    n_1 = torch.zeros(1, dtype=torch.long)
    with torch.no_grad(), dropless(model):
        while True:
            dist.broadcast(n_1, src=0)
            n = int(n_1.item())
            if n < 0:
                return 0
            for _ in range(n):
                idle_forward(model)


def serve_main(model: CausalLM, tokenizer: Tokenizer, name: str, host: str, port: int,
               max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 64,
               lockstep: bool = False, log_level: str = "warning",
               eos: Sequence[int] = (), engine: dict[str, Any] | None = None) -> int:
    """Rank 0 (or the only process): serve until SIGTERM/SIGINT; the exit code.
    ``eos``: the token ids that end a request (a Hugging Face folder's eos_token_id);
    ``engine``: the Engine's keyword settings (max_batch_tokens, prefix_cache_tokens,
    engine)."""
    try:
        sock = bind(host, port)
    except PortInUse as e:
        print(f"moebit serve: error: {e}", file=sys.stderr, flush=True)
        if lockstep:
            broadcast_step(-1)  # the other ranks wait for rank 0's first word: stop
        return PORT_IN_USE
    metrics = Metrics()
    metrics.watch_experts(model)
    engine = Engine(model, tokenizer, max_batch, max_queue, prefill_chunk,
                    broadcast_step if lockstep else None, metrics, eos, **(engine or {}))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, tokenizer, name), host=host,
                                           port=port, log_level=log_level))

    def failed() -> None:
        print(f"moebit serve: error: the engine failed ({engine.failed}); stopping",
              file=sys.stderr)
        server.should_exit = True

    engine.on_failure = failed
    thread = threading.Thread(target=engine.run, name="moebit-engine", daemon=True)
    thread.start()
    print(f"moebit serve: {name} on http://{host}:{port} (max batch {max_batch}, "
          f"queue {max_queue})", file=sys.stderr, flush=True)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler it found:
    # make that a no-op, so a drained server exits 0 rather than dying by the signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    engine.stop()
    thread.join(timeout=60)
    if thread.is_alive():
        print("moebit serve: error: the engine did not stop", file=sys.stderr)
        return 1
    return 0 if engine.failed is None else 1
