"""What layers of unequal cost change outside the model (megalite/model/pattern.py `layer_costs`): the pipeline
split balanced by cost, the estimator's attention FLOPs (a sliding layer counted at what it computes), its MFU
conventions, the slowest stage, and the KV cache a windowed layer keeps."""

from __future__ import annotations

import pytest

from megalite.config import parse_args, resolve
from megalite.errors import ConfigError
from megalite.perfmodel.config_inputs import layer_windows, presets, spec_dims
from megalite.perfmodel.flops import attention_keys, flops_per_token, model_flops_per_token, pipeline_imbalance
from megalite.pipeline.partition import balanced_counts
from tests.layer_pattern_utils import gemma3_cfg


def test_balanced_counts_minimise_the_costliest_stage() -> None:
    assert balanced_counts([1.0, 1.0, 1.0, 10.0], 2) == [3, 1]
    assert balanced_counts([1.0] * 4, 2) == [2, 2]
    assert balanced_counts([3.0, 1.0, 1.0, 1.0, 3.0], 3) == [1, 3, 1]
    with pytest.raises(ConfigError, match="cannot fill 5 pipeline stages"):
        balanced_counts([1.0] * 4, 5)


def _costs(preset: str, pp: int, seq: int) -> tuple[list[int], list[float]]:
    from megalite.config import ModelArgs
    from megalite.model.pattern import layer_costs

    cfg = resolve(parse_args(["--model.preset", preset, "--parallel.pp", str(pp), "--model.seq_len", str(seq)]), pp)
    return cfg.parallel.pp_layers, layer_costs(ModelArgs.from_config(cfg))


def _stage_max(counts: list[int], costs: list[float]) -> float:
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start:start + c]))
        start += c
    return max(out)


def test_a_pattern_run_splits_its_pipeline_by_cost() -> None:
    """tiny-gemma3 (5 sliding layers of W = 32, then a full one) on 2 stages at 4K tokens: the derived
    parallel.pp_layers make the costliest stage cheaper than the split by count; gemma3-1b's 26 layers fill 3
    stages (no split by count exists); a model of like layers keeps the even split."""
    counts, costs = _costs("tiny-gemma3", 2, 4096)
    assert max(costs) > 3 * min(costs)  # a full layer at 4K tokens against a 32-token window
    assert sum(counts) == 6 and _stage_max(counts, costs) < _stage_max([3, 3], costs)
    counts, costs = _costs("gemma3-1b", 3, 32768)
    assert sum(counts) == 26 and len(counts) == 3 and _stage_max(counts, costs) <= sum(costs) / 3 * 1.15
    assert _costs("llama-1b", 4, 2048)[0] == []  # uniform: the even split (pp_layers left empty)


def test_attention_keys_count_the_pairs_a_window_computes() -> None:
    s, w = 50, 8
    pairs = sum(1 for i in range(s) for j in range(s) if i - w < j <= i)  # variant.py's window, counted by hand
    assert attention_keys(s, 1, (w,), causal=True) == pytest.approx(pairs / s)
    assert attention_keys(s, 1, (w,)) == w  # the full count: S x min(S, W) / S
    assert attention_keys(s, 3) == attention_keys(s, 3, (None, None, None)) == 3 * s
    assert attention_keys(s, 3, causal=True) == 1.5 * s  # PaLM's halved full layers, as before
    n, h = 1000, 64
    assert model_flops_per_token(n, 2, h, s, windows=(None, w)) == 6 * n + 12 * h * (s + w)
    assert model_flops_per_token(n, 2, h, s, causal=True) == 6 * n + 6 * 2 * h * s  # unchanged without windows


def test_the_estimator_prices_windowed_layers_at_what_they_compute() -> None:
    m = gemma3_cfg(vocab_size=61, seq_len=64)
    dims = spec_dims(m)
    assert dims.windows == (4, 4, 4, 4, 4, None) == layer_windows(m)
    full = spec_dims(gemma3_cfg(vocab_size=61, seq_len=64, layer_types=[], sliding_window=0))
    assert full.windows is None
    model_w, hw_w = flops_per_token(dims, 1000, "none")
    model_f, hw_f = flops_per_token(full, 1000, "none")
    attn = dims.num_heads * dims.hd
    assert model_f - model_w == pytest.approx(12 * attn * 5 * (64 - 4))  # 5 sliding layers at 4 keys, not 64
    assert hw_f - hw_w == pytest.approx(12 * attn * 5 * (64 - 4))
    assert pipeline_imbalance(full, 2) == 1.0 and pipeline_imbalance(dims, 1) == 1.0
    assert pipeline_imbalance(dims, 2) > 1.0  # one full layer among five cheap ones: no split is even
    assert presets()["gemma3-1b"]["windows"] == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))


def test_the_estimate_says_its_window_convention_and_kv_cache() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "tools/estimate.py", "--preset", "gemma3-1b", "--device", "h100"],
                         capture_output=True, text=True, check=True).stdout
    assert "sliding-window layers: 22 of 26 (W = 512): MFU counts their attention at min(s, W) keys" in out
    assert "KV cache for generation at 32768 tokens: 0.1458 GB per sequence" in out  # 4 x 32768 + 22 x 512 positions
