"""The signal handlers a launcher must give back after running ranks in-process."""

from __future__ import annotations

import signal
import threading
from typing import Any

_TORCHRUN_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                          if hasattr(signal, n))


def signal_handlers() -> dict[int, Any]:
    """This process's handlers for the signals torchrun's agent takes over (it installs its
    own and never puts them back), so that a caller running the ranks in-process (a test, a
    notebook, a script calling moebit.cli.main) gets its own handlers back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in _TORCHRUN_SIGNALS}


def restore_signal_handlers(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
