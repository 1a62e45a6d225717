"""Shapes-only builds (the launcher's memory check, ``moebit plan memory``, the folder
checks) run no initializer and no meta arithmetic, so they never import ``torch._dynamo``
(seconds of every launcher's start), while a family's own meta build keeps its
initializers for the sharded run's recorded replay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hf_models import make_hf_model

CHECK = """
import sys
from pathlib import Path
import torch
from moebit.models.gpt import GPTConfig
from moebit.models.gpt_family import GPT_FAMILY
from moebit.models.meta import on_meta
from moebit.models.registry import family_of_folder

folder = Path(sys.argv[1])
fam = family_of_folder(folder)
with on_meta():
    hf = fam.build(fam.read_folder_config(folder, 1), device="meta")
    gpt = GPT_FAMILY.build(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16),
                           device="meta")
tensors = [*hf.parameters(), *hf.buffers(), *gpt.parameters(), *gpt.buffers()]
assert tensors and all(t.is_meta for t in tensors)
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""


def test_shapes_only_builds_do_not_import_dynamo(tmp_path: Path) -> None:
    make_hf_model("qwen2_moe", tmp_path / "hf", vocab_size=320)
    out = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "no dynamo"


def test_rope_of_a_meta_model_is_exact_once_materialised(tmp_path: Path) -> None:
    from moebit.models.meta import on_meta
    from moebit.models.registry import family_of_folder

    folder = tmp_path / "hf"
    make_hf_model("qwen2_moe", folder, vocab_size=320)
    fam = family_of_folder(folder)
    cfg = fam.read_folder_config(folder, 1)
    with on_meta():
        meta = fam.build(cfg, device="meta")
    real = fam.build(cfg)
    meta.to_empty(device="cpu")
    got = {n: b for n, b in meta.named_buffers() if "inv_freq" in n}
    want = {n: b for n, b in real.named_buffers() if "inv_freq" in n}
    assert got and got.keys() == want.keys()
    for name, b in want.items():
        assert got[name].dtype == b.dtype and bool((got[name] == b).all()), name
