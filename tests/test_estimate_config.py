"""tools/estimate.py --config prices what the config would run: its `[fp8]` recipe, its optimizer and Muon's
Newton-Schulz steps (explicit flags still win), and refuses what the run would refuse, by the features' own
rules (`[moe]`, `[fp8]`, `[optimizer]`/`[muon]` problems): experts -4 (a negative parameter count), top_k 99
(more active than total), an fp8 recipe e5m2. tools/plan.py refuses an unknown pipeline schedule, and one its
MoE planner does not price, in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_bad_inputs import CONFIG
from tools.estimate import main as estimate_main
from tools.plan import main as plan_main

MOE_CONFIG = """[model]
preset = "tiny-moe"
[fp8]
recipe = "rowwise"
[optimizer]
name = "muon"
[muon]
ns_steps = 10
"""


def _estimate(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert estimate_main([*argv, "--dp", "2", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line (an old config name may add its one-line `note:` before it)."""
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("note:")]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_the_config_s_fp8_and_optimizer_are_priced(tmp_path: Path, capsys) -> None:
    path = tmp_path / "moe.toml"
    path.write_text(MOE_CONFIG)
    got = _estimate(capsys, "--config", str(path))
    assert got["fp8"] is not None and got["moe"]["fp8"] is not None  # the blocks' and the experts' FP8 GEMMs
    assert got["muon"]["ns_flops_per_rank"] > 0 and got["moe"]["muon_experts"]["ns_flops_per_rank"] > 0
    # Newton-Schulz FLOPs scale with muon.ns_steps: the config's 10 steps are twice the default 5
    five = _estimate(capsys, "--config", str(path), "--muon.ns_steps", "5")
    assert got["muon"]["ns_flops_per_rank"] == 2 * five["muon"]["ns_flops_per_rank"]
    # explicit flags win over the config
    flags = _estimate(capsys, "--config", str(path), "--fp8", "none", "--optimizer", "adamw")
    assert flags["fp8"] is None and "muon" not in flags and "fp8" not in flags["moe"]


@pytest.mark.parametrize("flags,needle", [
    (["--moe.experts", "-4"], "moe.experts must be >= 0"),
    (["--model.moe_experts", "-4"], "moe.experts must be >= 0"),  # the old name, mapped by aliases.py
    (["--moe.top_k", "99"], "moe.top_k 99"),
    (["--train.fp8", "e5m2"], "fp8.recipe: 'e5m2'"),
    (["--fp8.recipe", "e5m2"], "fp8.recipe: 'e5m2'"),
    (["--muon.ns_steps", "1000000000"], "muon.ns_steps"),
    (["--optimizer.name", "sgd"], "optimizer.name"),
])
def test_what_the_run_would_refuse_is_not_priced(tmp_path: Path, capsys, flags: list[str], needle: str) -> None:
    path = tmp_path / "moe.toml"
    path.write_text(MOE_CONFIG)
    capsys.readouterr()
    assert estimate_main(["--config", str(path), *flags]) == CONFIG
    assert needle in _error_line(capsys)


@pytest.mark.parametrize("preset,schedules,needle", [
    ("tiny-moe", "foo", "--schedules 'foo'"), ("tiny", "foo", "--schedules 'foo'"),
    ("tiny-moe", "interleaved", "--schedules not supported for a MoE model"),
])
def test_the_planner_refuses_a_schedule_it_does_not_price(capsys, preset: str, schedules: str, needle: str) -> None:
    capsys.readouterr()
    assert plan_main(["--preset", preset, "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80",
                      "--global-batch-size", "64", "--schedules", schedules]) == CONFIG
    assert needle in _error_line(capsys)
