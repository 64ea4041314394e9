"""An MLA model with model.kernels=triton (CPU interpreter) equals model.kernels=torch, with the flash kernel
running its attention core (v zero-padded to the q/k width, megalite/mla/attention.py) and the fused RoPE on
its decoupled RoPE part. Tolerance as tests/test_model_kernels.py: the kernels compute the same functions with
other blockings, fp32 round-off ~1e-7 per op; after 2 AdamW steps at lr 1e-2 the losses agree to 1e-5."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
kernels = pytest.importorskip("megalite.kernels")

from megalite.context.options import ContextOptions  # noqa: E402
from megalite.mla.config import MLAConfig  # noqa: E402
from megalite.model.gpt import GPT  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.training.step import train_step  # noqa: E402
from tests.parallel_utils import (reference_optimizer, step_context, tiny_model_cfg, tiny_train_cfg,  # noqa: E402
                                  with_sections)
from tests.test_model_kernels import count_calls  # noqa: E402

if not kernels.available():
    pytest.skip("triton is not installed", allow_module_level=True)

MLA = MLAConfig(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)


def _losses(kind: str, eod: int | None = None) -> list[float]:
    cfg = tiny_model_cfg(kernels=kind, hidden_size=64, num_heads=4, num_kv_heads=4, num_layers=1,
                         seq_len=8 if eod is None else 16)
    state = ParallelState()
    model = GPT(with_sections(cfg, mla=MLA), state, seed=3, context=ContextOptions(document_eod=eod))
    opt = reference_optimizer(model, state)
    gen = torch.Generator().manual_seed(4)
    out = []
    for i in range(2):
        d = torch.randint(1, cfg.vocab_size, (2 if eod is None else 1, cfg.seq_len + 1), generator=gen)
        if eod is not None:  # documents of 3, 7 and 6 tokens (boundaries inside the kernel's 16-wide tiles)
            d[:, [2, 9]] = eod
        out.append(train_step(step_context(model, state, torch.float32, tiny_train_cfg(2)), opt,
                              [(d[:, :-1], d[:, 1:])], i).loss)
    return out


def test_triton_mla_matches_torch(monkeypatch) -> None:
    calls = count_calls(monkeypatch, "flash_attention", "apply_rope")
    ref, tri = _losses("torch"), _losses("triton")
    assert tri == pytest.approx(ref, abs=1e-5)
    assert calls == {"flash_attention": 2, "apply_rope": 2}  # one forward per step, one layer


def test_triton_mla_under_document_masking_matches_torch(monkeypatch) -> None:
    """data.document_mask: the flash kernel's segment ids on the padded core against masked SDPA."""
    calls = count_calls(monkeypatch, "flash_attention")
    assert _losses("triton", eod=0) == pytest.approx(_losses("torch", eod=0), abs=1e-5)
    assert calls == {"flash_attention": 2}


def test_wide_heads_run_torch_attention_said_once(caplog) -> None:
    """Past the flash kernel's tested width (q/k 136 here) the attention core runs SDPA, said once for all layers."""
    from megalite.mla.attention import FLASH_MAX_HEAD_DIM, _log_torch_core
    from megalite.model.ops import TORCH_OPS

    _log_torch_core.cache_clear()  # once per process: forget an earlier test's

    wide = MLAConfig(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=FLASH_MAX_HEAD_DIM, v_head_dim=12)
    cfg = tiny_model_cfg(kernels="triton", hidden_size=64, num_heads=4, num_kv_heads=4, num_layers=3, seq_len=8)
    with caplog.at_level("WARNING", logger="megalite.mla.attention"):
        model = GPT(with_sections(cfg, mla=wide), ParallelState(), seed=3)
    assert all(block.attn.ops is TORCH_OPS for block in model.layers.values())
    assert sum("exceeds the Triton flash kernel" in r.message for r in caplog.records) == 1
