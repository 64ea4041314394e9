"""The estimator's MoE numbers: published total/active parameter counts, the balanced all-to-all bytes against
the measured-routing formula, and tools/estimate.py's MoE section. (Measured 'ep' bytes of real runs equal
`a2a_bytes_measured` of their routing: tests/test_moe_ep.py.)"""

from __future__ import annotations

from dataclasses import asdict

from megalite.config import PRESETS, ModelConfig
from megalite.config.derive import resolve
from megalite.config.schema import Config
from megalite.perfmodel.inputs import Precision
from megalite.perfmodel.moe import a2a_bytes_balanced, a2a_bytes_measured, moe_estimate, moe_param_counts


def _model(preset: str):
    return resolve(Config(model=ModelConfig(**{**asdict(ModelConfig()), **PRESETS[preset]})), 1).model


def test_mixtral_8x7b_counts_match_the_published_46_7b_total_12_9b_active() -> None:
    c = moe_param_counts(_model("mixtral-8x7b"))
    assert round(c.total / 1e9, 1) == 46.7 and round(c.active / 1e9, 1) == 12.9  # Jiang et al. 2024


def test_balanced_bytes_equal_the_measured_formula_at_balanced_routing() -> None:
    tokens, k, e, h, ep = 64, 2, 8, 16, 4
    off = 2 * tokens * k * (ep - 1) // ep  # sent + received off-rank rows when every rank gets 1/ep
    assert a2a_bytes_balanced(tokens, k, e, h, ep, 4) == a2a_bytes_measured(off, 1, ep, e, h, 4)
    assert a2a_bytes_balanced(tokens, k, e, h, 1, 4) == 0


def test_experts_and_their_states_split_over_ep_and_edp() -> None:
    m = _model("mixtral-8x7b")
    one = moe_estimate(m, 1, 1, 8, 1, 1, 1, 1, 1, False, Precision())
    eight = moe_estimate(m, 1, 1, 8, 1, 8, 1, 1, 1, False, Precision())
    assert eight.expert_params_per_rank * 8 == one.expert_params_per_rank
    assert eight.memory.params < one.memory.params and one.ep_bytes_per_step == 0 < eight.ep_bytes_per_step


def test_tools_estimate_prints_the_moe_section(capsys) -> None:
    from tools.estimate import main

    assert main(["--preset", "mixtral-8x7b", "--dp", "8", "--ep", "8", "--zero", "1"]) == 0
    out = capsys.readouterr().out
    assert "46.703 B total, 12.880 B active" in out and "GB per step per rank ('ep')" in out
