"""The tiny gpt-oss-like and Gemma 3-like models (tests/layer_pattern_utils.py: sliding windows that bite, sinks and
biases away from zero, a clamped-SwiGLU MoE with biases; 5 local : 1 global layers with their own RoPE bases, q/k
and sandwich norms, GeGLU, embedding scale, query_pre_attn_scalar and soft-caps) trained at each layout against the
single-process run: each step's loss and gradient norm, and every parameter after 3 AdamW steps.

Tolerances: tests/test_cp_training.py's (the layouts sum the same terms in another order: losses to 1e-5, norms to
1e-5 relative, parameters to 1e-4 after 3 steps at lr 1e-2, where a wrong shard, mask or missing reduction moves them
by O(lr)); FP8: tests/test_fp8_training.py's (rounding flips after the first step). pp2 splits the layers unequally
(a stage of one sliding layer beside one of three; of two and of four), so each stage builds its layers' own specs
and RoPE tables from their global indices."""

from __future__ import annotations

import pytest

from tests.layer_pattern_ranks import check_layout

LAYOUTS: dict[str, list[dict[str, object]]] = {
    "gpt-oss": [dict(tp=2, sp=True), dict(pp=2, pp_layers=[1, 3]), dict(zero=3), dict(ep=2),
                dict(tp=2, sp=True, fp8="tensorwise")],
    "gemma3": [dict(tp=2, sp=True), dict(pp=2, pp_layers=[2, 4]), dict(zero=3), dict(tp=2, sp=True, fp8="tensorwise")],
    "gated": [dict(tp=2, sp=True)],
}


@pytest.mark.parametrize("kind,run", [(k, r) for k, runs in LAYOUTS.items() for r in runs],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{v}" for k, v in v.items()))
def test_layouts_match_one_process(dist_world, kind: str, run: dict) -> None:
    dist_world(2).run(check_layout, kind, run)
