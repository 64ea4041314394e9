"""bench/attention_window.py can't rot: its smoke run writes its table, the ring planner's blocks equal the closed
form, the kernels' tile counters equal theirs (the script asserts both), and the windowed rows cost less."""

from __future__ import annotations

import json
from pathlib import Path

from bench.attention_window import main


def test_attention_window_smoke(tmp_path: Path) -> None:
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "attention_window_smoke.json").read_text())
    assert res["smoke"] is True and res["interpreter_checks"]
    for c in res["interpreter_checks"]:
        assert c["tiles_measured"] == c["tiles_closed_form"]
    windowed = [r for r in res["rows"] if r["window"] is not None]
    assert windowed and all(r["pairs_vs_full"] < 1 and r["ring_blocks_skipped"] > 0 for r in windowed)
    assert "ring blocks" in (tmp_path / "attention_window_smoke.md").read_text()
