"""Argument helpers shared by every ``moebit`` command: one way to turn bad input into one line.

Each command module builds its own argparse parser; what they share is here: the
``UsageError`` every command raises for bad input, the flags generated from a config
dataclass, and a ``parse_known_args`` that reports argparse's complaints as that error.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

from moebit.models.kv_cache import KV_CACHE_DTYPES
from moebit.training.config import flat_fields


class UsageError(ValueError):
    """Bad command-line input; the message names the flag or the file."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


CONFIG_GROUPS = (("model", "model (also keys of --config)"),
                 ("moe", "mixture of experts (used when --num-experts > 0)"),
                 ("train", "training (also keys of --config)"))


def add_config_flags(ap: argparse.ArgumentParser, skip: Iterable[str] = ()) -> None:
    """One flag per flat config key (``n_layer`` becomes ``--n-layer``), grouped by the config
    that owns it; values stay strings so the config's own checks convert them and name the
    key when they fail."""
    skipped = set(skip)
    for owner, title in CONFIG_GROUPS:
        group = ap.add_argument_group(title)
        for key, f in flat_fields(owner):
            if key in skipped:
                continue
            if f.type in ("bool", bool, "bool | None"):
                group.add_argument(flag(key), action=argparse.BooleanOptionalAction)
            else:
                group.add_argument(flag(key), metavar=key.upper())


def add_kv_cache_flag(ap: argparse.ArgumentParser) -> None:
    """``--kv-cache`` of ``generate`` and ``serve`` (``models.kv_cache.set_kv_dtype``)."""
    ap.add_argument("--kv-cache", choices=tuple(KV_CACHE_DTYPES), default=None,
                    help="dtype of the cached keys and values (default: the weights'); "
                         "float16 halves what a decode step reads from the cache "
                         "(llama.cpp's default), the arithmetic stays float32")


def parse_known(ap: argparse.ArgumentParser, argv: list[str],
                cmd: str) -> tuple[argparse.Namespace, list[str]]:
    """argparse's parse_known_args, with its exit on bad input turned into a UsageError
    (``--help`` still exits).

    A value that starts with '-' and reads as a number (``--lr -1e-3``) is joined to its
    flag first: argparse would otherwise take it for an unknown option.
    """
    try:
        return ap.parse_known_args(join_negative_values(argv))
    except SystemExit as e:
        if e.code == 0:  # --help
            raise
        raise UsageError(f"bad arguments to moebit {cmd} (see above)") from e


def join_negative_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _is_number(a) and a[0] == "-":
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def unknown_flag_error(unknown: list[str], cmd: str) -> UsageError:
    """The error for the first unknown argument; a stray existing path is most often a glob
    the shell expanded, so that case says to quote it."""
    first = unknown[0]
    if not first.startswith("-") and os.path.exists(first):
        return UsageError(
            f"unexpected argument {first!r} for moebit {cmd}: it is an existing path; if it came "
            "from a glob (--data *.txt), quote the glob so moebit expands it: --data '*.txt'")
    return UsageError(f"unknown flag {first!r} for moebit {cmd} (see moebit {cmd} --help)")


class RunStopped(Exception):
    """The run was stopped by SIGINT / SIGTERM; ``code`` is the exit code (130 / 143)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
