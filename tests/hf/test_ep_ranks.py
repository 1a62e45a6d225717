"""Expert parallelism over 2 gloo ranks: same logits as one process, each rank reads its experts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hf_models import make_hf_model

from moebit.testing import run_on_ranks

transformers = pytest.importorskip("transformers")


def _ep_rank(rank: int, world: int, folder: str, out: str) -> dict:
    from moebit.hf import build_empty, load_hf_weights, read_config, save_pretrained

    torch.set_num_threads(1)
    model = build_empty(read_config(folder, ep_size=world)).eval()
    report = load_hf_weights(model, folder)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(ids).logits
    save_pretrained(model, out)
    return {"logits": logits, "read": report.tensors_read}


def test_sharded_checkpoint_ep2_reads_only_own_experts(tmp_path):
    from moebit.hf import from_pretrained

    ref = make_hf_model("mixtral", tmp_path / "src", num_local_experts=4)
    ref.save_pretrained(tmp_path / "src", max_shard_size="40KB")  # several shards + index
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    results = run_on_ranks(_ep_rank, world=2, args=(str(tmp_path / "src"), str(tmp_path / "out")),
                           timeout=240)
    single = from_pretrained(tmp_path / "src")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = single(ids).logits
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["logits"], want, atol=1e-5, rtol=0)
        experts = {int(m.group(1)) for n in res["read"]
                   if (m := re.search(r"\.experts\.(\d+)\.", n))}
        assert experts == {2 * rank, 2 * rank + 1}
        per_rank = 3 * 2 * len(single.config.moe_layers)  # w1/w2/w3 x 2 experts x layers
        assert sum(".experts." in n for n in res["read"]) == per_rank
    # the EP-saved folder (one expert shard per rank) loads in one process and in transformers
    out = Path(tmp_path / "out")
    assert len(list(out.glob("model-*.safetensors"))) == 3
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(out)(ids).logits, want, atol=0, rtol=0)
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(back(ids).logits, want, atol=1e-4, rtol=0)
