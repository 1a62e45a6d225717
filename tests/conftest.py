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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``cuda``-marked test, with the reason, where no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
