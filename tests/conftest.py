"""Shared fixtures: a small real-text corpus (stdlib sources) for fast training tests, and
one intra-op thread for tests that compare kernels (``pytestmark = usefixtures("one_thread")``).

Kernel autotuning is off for the whole session (``MOEBIT_AUTOTUNE=0``, inherited by the
ranks tests start): "auto" then picks the same kernel on every run and every machine
load, so results do not depend on timing. tests/moe/test_autotune.py turns it on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moebit.training.data import stdlib_files

os.environ.setdefault("MOEBIT_AUTOTUNE", "0")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with ~600 KB of real Python source copied from the standard library."""
    root, files = stdlib_files()
    out = tmp_path_factory.mktemp("corpus")
    total = 0
    for f in files:
        if total > 600_000:
            break
        data = f.read_bytes()
        dst = out / f.relative_to(root).as_posix().replace("/", "__")
        dst.write_bytes(data)
        total += len(data)
    return out


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): kernel choices and float sums
    then do not depend on the machine's core count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# A test file that starts processes (ranks, the CLI) costs seconds per test, a plain one
# milliseconds: what the ordering below goes by (no timing from any one machine).
_SPAWNS = ("run_on_ranks", "subprocess", "run_moebit", "run_ranks", "Popen")


def _file_weight(items: list[pytest.Item]) -> tuple[int, int]:
    slow = sum(item.get_closest_marker("slow") is not None for item in items)
    try:
        source = Path(str(items[0].fspath)).read_text()
    except OSError:
        source = ""
    return slow, int(any(word in source for word in _SPAWNS)) * len(items)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Heaviest files first, then skip every ``cuda``-marked test where no CUDA device is
    visible (with the reason).

    Files with slow tests, then files that start processes, run before the rest (order
    kept within a file): under ``make test``'s two workers (``--dist loadfile
    --no-loadscope-reorder``) the long files start early and the quick ones fill in at
    the end, instead of one worker finishing a long file alone while the other idles.
    """
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(str(item.fspath), []).append(item)
    weights = {f: _file_weight(group) for f, group in by_file.items()}
    order = sorted(by_file, key=lambda f: (-weights[f][0], -weights[f][1]))
    items[:] = [item for f in order for item in by_file[f]]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
