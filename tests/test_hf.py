"""Hugging Face export/import: transformers computes megalite's logits; import(export(x)) == x exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.checkpoint.sharded import load_sharded, read_index, save_sharded
from megalite.checkpoint.storage import SlabReader
from megalite.errors import CheckpointError
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.parallel_utils import tiny_model_cfg
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")

VOCAB = 67
# Same weights, same fp32 math, different op order (HF's eager attention is matmul + softmax, megalite's is
# SDPA; HF's gelu_new is the tanh formula written out): logits of O(1) agree to a few ulps, ~1e-6. 1e-5 is
# far below any mapping error (a swapped q/k, an untransposed Conv1D or gate/up give O(0.1) differences).
LOGITS_ATOL = 1e-5


def _all_params(path: Path) -> dict[str, torch.Tensor]:
    index = read_index(path)
    reader = SlabReader(path, index)
    return {k: reader.read_region(k, (0,) * len(v["shape"]), tuple(v["shape"]))
            for k, v in index["tensors"].items() if k.startswith("param/")}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_load_import(tmp_path: Path, arch: str) -> None:
    cfg = tiny_model_cfg(arch, vocab_size=VOCAB, seq_len=16)
    st = ParallelState()
    model = GPT(cfg, st, seed=5).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move norms off 1 and biases off 0, so a wrong mapping of them shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ckpt = save_sharded(tmp_path / "ckpt", 1, model, None, {}, st, keep=0)
    hf_dir = tmp_path / "hf"
    assert export_main(["--input", str(ckpt), "--output", str(hf_dir), "--quiet"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, cfg.seq_len), generator=gen)
    with torch.no_grad():
        ours = model(ids)[..., :VOCAB]
        theirs = hf_model(ids).logits
    err = (ours - theirs).abs().max().item()
    assert err <= LOGITS_ATOL, f"{arch}: transformers logits differ from megalite's by {err:.2e}"

    back = tmp_path / "back"
    assert import_main(["--input", str(hf_dir), "--output", str(back), "--quiet"]) == 0
    before, after = _all_params(ckpt), _all_params(back)
    assert sorted(before) == sorted(after)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    fresh = GPT(cfg, st, seed=9).eval()
    extra = load_sharded(back, fresh, None, st)
    assert extra["step"] == 0 and not extra["has_optimizer_state"]
    with torch.no_grad():
        assert torch.equal(fresh(ids)[..., :VOCAB], ours)


def test_import_refuses_unsupported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    assert import_main(["--input", str(tmp_path), "--output", str(tmp_path / "out"), "--quiet"]) == \
        CheckpointError.exit_code
