"""``.ci/gpu`` where no GPU is visible: one line saying so, exit status 0, nothing run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "gpu"


def test_ci_gpu_without_a_gpu_prints_one_line_and_succeeds():
    assert os.access(SCRIPT, os.X_OK), f"{SCRIPT} must be executable"
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this checks the same path on a GPU host;
    # MOEBIT_PYTHON skips `make venv` (this interpreter already has the project).
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MOEBIT_PYTHON=sys.executable)
    res = subprocess.run([str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], res.stdout
