"""The tiny gpt-oss-like and Gemma 3-like models (tests/layer_pattern_utils.py) trained under context parallelism in
each mode WITH document masking, against the single-process run of the same documents: each step's loss and gradient
norm and every parameter after 3 AdamW steps (tests/layer_pattern_ranks.py, its tolerances and why).

The windows bite across cp chunks: W = 4 over 16 tokens, so at cp2 a zigzag chunk is 4 tokens and a query sees at
most the one chunk before its own (the ring skips the chunk pairs two apart and further); at cp4 (hybrid, 2 x 2) a
chunk is 2 tokens and a window spans three. EOD ends about one token in five, so documents start and end inside
windows and inside chunks. gpt-oss adds sinks (sharded with the heads under a2a), gemma3 the soft-cap and
query_pre_attn_scalar. Each mode computes the same masks its own way (ring: block masks and skipped pairs; allgather:
the gathered keys; a2a: whole-sequence attention on heads/cp; hybrid: both)."""

from __future__ import annotations

import pytest
import torch

from tests.layer_pattern_ranks import check_layout

DOCS: dict[str, object] = dict(cp=2, docs=True)
CASES: list[tuple[int, str, dict]] = [
    *[(2, kind, dict(DOCS, cp_mode=mode)) for kind in ("gpt-oss", "gemma3") for mode in ("ring", "allgather", "a2a")],
    (4, "gpt-oss", dict(cp=4, cp_mode="hybrid", cp_a2a=2, docs=True)),
    (4, "gemma3", dict(cp=4, cp_mode="hybrid", cp_a2a=2, docs=True)),
]


@pytest.mark.parametrize("world,kind,run", CASES,
                         ids=lambda v: v if isinstance(v, (str, int)) else "-".join(f"{k}{v}" for k, v in v.items()))
def test_cp_modes_with_documents_match_one_process(dist_world, world: int, kind: str, run: dict) -> None:
    dist_world(world).run(check_layout, kind, run)


def test_a2a_variant_under_selective_recompute_matches_one_process(dist_world) -> None:
    """Selective recompute at cp2 a2a with a window, sinks and documents: the same losses, norms and parameters."""
    dist_world(2).run(check_layout, "gpt-oss", dict(DOCS, cp_mode="a2a", recompute="selective"))

