"""bench/kernels_gpu.py must not rot: its --smoke mode runs here (interpreter, tiny shapes)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU via numpy

import pytest

pytest.importorskip("triton")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kernels_gpu.py"


def test_kernel_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("kernels_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kernels_gpu", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    # Two cheap kernels; the attention and RoPE interpreter runs would cost seconds each.
    assert bench.main(["--smoke", "--only", "rms_norm", "swiglu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["kernel"], r["impl"]) for r in rows} == {
        ("rms_norm", "torch eager"), ("rms_norm", "triton"), ("swiglu", "torch eager"), ("swiglu", "triton")}
    assert all(r["fwd_ms"] > 0 and r["total_ms"] > 0 for r in rows)
