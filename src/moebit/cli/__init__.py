"""The ``moebit`` command: one module per sub-command, all argparse, one torchrun launcher.

    moebit train --nproc 2 --steps 300                  # 2 ranks on this machine
    moebit train --config run.toml --lr 3e-4            # a file, flags override it
    moebit train --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 ...   # multi-node
    moebit report runs/a runs/b                         # curves on shared axes + table
    moebit bench comm --link 1gbit                      # benchmarks (see docs/benchmarks.md)
    moebit generate runs/a --prompt "def "              # text from a trained run
    moebit eval runs/a runs/b                           # val loss on the whole split
    moebit distill --teacher runs/a --student-layers 3  # Mixture-of-Students
    moebit upcycle runs/a --num-experts 8 --run-dir runs/a-moe   # dense -> MoE
    moebit plan --model bert-large --cluster tang2021-ethernet   # predict a cluster we lack
    moebit train --init-from hf/mixtral --ep-size 2 --nproc 2   # fine-tune a HF model
    moebit export runs/ft --to hf/mixtral-ft            # back to a Hugging Face folder
    moebit serve runs/a --port 8000                     # OpenAI-compatible HTTP server
    moebit demo                                         # the guided tour

Ranks are launched by torch.distributed.run (torchrun); this process only validates the
configuration, prepares the run folder, and supervises (``moebit.cli.launch``).
"""

from __future__ import annotations

import importlib
import os
import sys

from moebit.checkpoint import CheckpointError
from moebit.cli.args import RunStopped, UsageError
from moebit.training.config import ConfigError

# Command name -> module under moebit.cli with main(argv). Imported on use, so that
# `moebit report` or `moebit --help` does not pay for torch.distributed and the models.
COMMANDS = {"train": "train", "report": "report", "bench": "bench", "demo": "demo",
            "generate": "generate", "eval": "eval", "distill": "distill", "upcycle": "upcycle",
            "plan": "plan", "export": "export", "serve": "serve"}

__all__ = ["COMMANDS", "UsageError", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("commands: " + ", ".join(COMMANDS))
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"moebit: unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"moebit.cli.{COMMANDS[cmd]}")
        return int(module.main(rest) or 0)
    except RunStopped as e:
        print(f"moebit {cmd}: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:  # before any rank started: nothing to stop or resume
        print(f"moebit {cmd}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, UsageError, CheckpointError, ValueError, RuntimeError) as e:
        print(f"moebit {cmd}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `moebit report ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
