"""``metrics.jsonl``: one JSON record per line, written whole, read tolerantly.

Writing: each record is one ``os.write`` of the whole line on an ``O_APPEND`` descriptor,
so a reader (or a crash) never sees half a record from a buffered flush. If the write
fails part-way (ENOSPC), the file is cut back to its previous length: the file then ends
on a whole line, and the error is raised naming the file.

Reading: a final line that is not valid JSON is what a crash mid-write leaves (power loss,
a filesystem that ignored the truncate); it is dropped with a warning naming the file, so
``--resume`` and ``moebit report`` still work. A bad line elsewhere is real damage and an
error naming the file and line.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

FILE_NAME = "metrics.jsonl"


class MetricsError(ValueError):
    """A metrics file is damaged somewhere other than its last line."""


class MetricsWriter:
    """Appends records to a metrics file; ``emit`` is the training loop's hook."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def emit(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode()
        start = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, line)
            if written != len(line):  # a short write: the disk filled up mid-line
                raise OSError(28, "No space left on device (short write)")
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass  # the reader drops a torn last line anyway
            raise OSError(e.errno, f"writing {self.path}: {e.strerror}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_lines(text: str, path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(records, the raw lines kept); a torn final line is dropped with a warning."""
    lines = text.split("\n")
    records, kept = [], []
    last = max((i for i, s in enumerate(lines) if s.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == last:
                warnings.warn(f"{path}: dropped a torn last line ({len(line)} bytes; a write "
                              "was cut short, e.g. by a full disk or a crash)", stacklevel=3)
                continue
            raise MetricsError(f"{path}:{i + 1}: not a JSON line (the file is damaged)") from None
        if not isinstance(rec, dict):
            raise MetricsError(f"{path}:{i + 1}: expected a JSON object")
        records.append(rec)
        kept.append(line)
    return records, kept


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every whole record of a metrics file, oldest first."""
    p = Path(path)
    return parse_lines(p.read_text(encoding="utf-8", errors="replace"), p)[0]


def read_run(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return read(Path(run_dir) / FILE_NAME)


def last_step(run_dir: str | os.PathLike[str]) -> int | None:
    """The highest step any record of the run mentions (None: no metrics yet)."""
    path = Path(run_dir) / FILE_NAME
    if not path.is_file():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            steps = [int(r["step"]) for r in read(path) if isinstance(r.get("step"), int)]
        except (OSError, MetricsError):
            return None
    return max(steps, default=0)
