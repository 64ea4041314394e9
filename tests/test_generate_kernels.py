"""KV-cached generation with model.kernels=triton (the CUDA default; CPU interpreter here, tiny shapes): the
cached decoder calls the kernels at one-token shapes and RoPE rows at an offset, which training never does."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
kernels = pytest.importorskip("megalite.kernels")

from megalite.inference.generate import SamplingConfig, generate_ids  # noqa: E402
from megalite.model.gpt import GPT  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from tests.parallel_utils import tiny_model_cfg  # noqa: E402

if not kernels.available():
    pytest.skip("triton is not installed", allow_module_level=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cached_generation_with_triton_kernels(arch: str) -> None:
    models = {}
    for kind in ("torch", "triton"):
        cfg = tiny_model_cfg(arch, kernels=kind, hidden_size=32, num_heads=4, num_kv_heads=2 if arch == "llama" else 4,
                             num_layers=2, seq_len=16, vocab_size=64)
        models[kind] = GPT(cfg, ParallelState(), seed=3).eval()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in models[kind].parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    prompt = [3, 9, 1]
    new = SamplingConfig(5)  # a prefill and 4 one-token steps at offsets 3-6 (each a launch of every kernel)
    want = list(generate_ids(models["torch"], prompt, new, use_cache=False))
    # Greedy tokens: the kernels differ from torch by fp32 round-off only (~1e-7 relative, see
    # test_model_kernels.py), far below the logit gaps between the top tokens of this sharpened model.
    assert list(generate_ids(models["triton"], prompt, new, use_cache=True)) == want
    assert list(generate_ids(models["triton"], prompt, new, use_cache=False)) == want
