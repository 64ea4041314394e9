"""The benchmarks can't rot: each runs end to end in its tiny smoke mode and writes its outputs.

These check that the scripts run and that what they report is consistent, never how fast anything
is (performance is shown by the benchmarks themselves, not by timed tests). No run has a wall-clock limit
of its own: a smoke run is correct however slowly a loaded machine runs it, and pytest's per-test
timeout (pyproject.toml) is the hang guard.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bench.results_io import spread
from tests.pool_pretrain import launched_env

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRITON_INTERPRET"):
        env.pop(k, None)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO), env=env)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_gpu_sh_smoke_writes_json_and_markdown(tmp_path: Path) -> None:
    proc = _run(["bash", "bench/gpu.sh", "--smoke"], tmp_path)
    assert "failed or timed out" not in proc.stdout, proc.stdout[-3000:]  # sections 5-7 log a failure, not exit
    assert (tmp_path / "long_seq_smoke.json").exists() and (tmp_path / "fp8_gpu.json").exists()
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert data["meta"]["smoke"] is True
    model = data["sections"]["model"]
    assert [r["variant"] for r in model["rows"]] == ["torch"]  # triton/compile are CUDA-only: noted, skipped
    assert all(r["tokens_per_s"] > 0 and r["loss"] == r["loss"] for r in model["rows"])  # finite loss (not NaN)
    assert any("model/compile" in n for n in data["notes"])
    impls = {r["impl"] for r in data["sections"]["attention"]["rows"]}
    assert impls >= {"sdpa kv repeated", "sdpa enable_gqa (megalite torch op)"}
    md = (tmp_path / "gpu_bench.md").read_text()
    assert "tokens/s" in md and "SMOKE" in md
    assert (tmp_path / "env.txt").exists() and (tmp_path / "gpu_bench.log").exists()
    moe = json.loads((tmp_path / "moe_gpu_smoke.json").read_text())["presets"]  # section 7: grouped == loop
    assert moe[0]["tokens_per_s"]["grouped"] > 0 and max(moe[0]["equal"].values()) < 2e-2
    if (REPO / "bench" / "kernels_gpu.py").exists():
        assert data["sections"]["kernels"]["rows"], "kernel table is empty"


def test_cpu_compare_smoke(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """In this process (one implementation after another, as the script runs them): its thread count is put
    back afterwards, and the environment's malloc choice keeps its process-wide `tune_malloc` off this one."""
    import torch

    from bench.cpu_compare import main

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))  # glibc's default: tune_malloc leaves it
    threads = torch.get_num_threads()
    try:
        assert main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads((tmp_path / "cpu_compare_smoke.json").read_text())
    assert {"megalite-llama", "minimal-llama", "megalite-gpt2"} <= res["tokens_per_s"].keys()
    # The reported ratio is the paired one of the reported throughputs (each repeat's two slots, then the spread).
    tps = res["tokens_per_s_all"]
    mega, minimal = tps["megalite-llama"], tps["minimal-llama"]
    assert len(mega) == len(minimal) == res["repeats"] and all(x > 0 for x in mega + minimal)
    assert res["ratios"]["megalite-llama/minimal-llama"] == {
        **spread([x / y for x, y in zip(mega, minimal)]), "best_of": max(mega) / max(minimal)}
    assert "megalite-llama/minimal-llama" in (tmp_path / "cpu_compare_smoke.md").read_text()


def test_scaling_smoke_measured_bytes_match_the_estimator(tmp_path: Path, demo_cache_dir: str, dist_world,
                                                          monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The script's driver in this process, on the session's demo corpus; its `--worker` ranks (the trainer, then
    the rank's peak RSS) in the warm gloo ranks, not a torchrun job: bench/cp_memory.py's smoke launches its cp = 2
    run through the same `run_script_ranks`, and tests/test_estimate_vs_measured.py holds measured tp = 2 SP bytes
    equal to the estimator's for more layouts. (A pool rank's peak RSS is its whole life's: the smoke's RSS column
    is not a measurement, as nothing in a smoke is.)"""
    from bench import scaling

    def pool_ranks(script: Path, nproc: int, argv: list[str], threads: int,
                   timeout_s: float) -> subprocess.CompletedProcess:
        assert script == Path(scaling.__file__).resolve() and threads == 1
        codes = dist_world(nproc).run(_as_launched, nproc, "bench.scaling", "worker", False, argv,
                                      timeout=timeout_s)
        return subprocess.CompletedProcess([], next((c for c in codes if c), 0), "", "")

    monkeypatch.setenv("MEGALITE_CACHE", demo_cache_dir)
    monkeypatch.setattr(scaling, "run_script_ranks", pool_ranks)
    assert scaling.main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "scaling_smoke.json").read_text())
    runs = {r["name"]: r for r in res["runs"]}
    tp = runs["tp=2 sp"]
    assert "skipped" not in tp, tp.get("skipped")
    # Both sides count the same collectives in the same wire-byte convention, so they agree
    # exactly up to float rounding of the Fraction sums (1e-9 relative).
    assert abs(tp["comm_bytes"]["tp"] - tp["predicted_comm_bytes"]["tp"]) <= 1e-9 * tp["comm_bytes"]["tp"]
    assert len(tp["peak_rss_bytes_per_rank"]) == 2
    assert (tmp_path / "scaling_smoke.md").exists()
    assert (tmp_path / "scaling_smoke.png").exists()


def _as_launched(rank: int, world: int, module: str, fn: str, with_rank: bool, *args: Any) -> Any:
    """`module.fn(*args)` (`fn(rank, *args)` `with_rank`) in a warm gloo rank with the variables torchrun would set
    (the trainer and DeepSpeed read them)."""
    with launched_env(rank, world):
        return getattr(importlib.import_module(module), fn)(*((rank,) if with_rank else ()), *args)


def test_dist_compare_smoke(tmp_path: Path, dist_world, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every layout runs against its peer after the loss check; DeepSpeed rows exist or a note says why not.
    The script's main runs here and its two ranks' part (`run_job`: all but the group's start) in the warm gloo
    ranks, not in three new processes."""
    from bench import dist_compare

    def pool_launch(job: dict, timeout: float = 7200) -> list[dict]:
        world = dist_compare.WORLD
        return dist_world(world).run(_as_launched, world, "bench.dist_compare", "run_job", True, job,
                                      timeout=timeout)

    monkeypatch.setattr(dist_compare, "launch", pool_launch)
    assert dist_compare.main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "dist_compare_smoke.json").read_text())
    rows = {r["layout"]["name"]: r for r in res["rows"]}
    assert {"ddp", "zero1", "zero2", "zero3", "tp", "tp-sp", "pp-1f1b", "pp-interleaved"} <= rows.keys()
    assert {"ds-zero1", "ds-zero2", "ds-zero3"} <= rows.keys() or any("DeepSpeed" in n for n in res["notes"])
    for name, row in rows.items():
        assert row["max_loss_diff"] <= 2e-4, name  # the script refuses to time beyond its LOSS_TOL anyway
        # One paired ratio per repeat (the smoke run's 1), positive, summarised as the table shows it.
        assert len(row["ratios"]) == res["repeats"] and all(r > 0 for r in row["ratios"]), name
        assert row["ratio"] == spread(row["ratios"]), name
        assert all(b > 0 for b in row["megalite"]["written_bytes_per_step"] + row["peer"]["written_bytes_per_step"])
    # gloo writes a reduce-scatter twice over (docs/tracking.md): with SP megalite writes more than it counts.
    sp = rows["tp-sp"]["megalite"]
    assert all(w > c for w, c in zip(sp["written_bytes_per_step"], sp["counted_bytes_per_step"]))
    assert "DTensor TP+SP" in (tmp_path / "dist_compare_smoke.md").read_text()


def test_threads_smoke_reports_every_configuration(tmp_path: Path) -> None:
    from megalite.runtime.threads import available_cores

    from bench.threads import main

    main(["--smoke", "--out", str(tmp_path)])  # the driver here; its workers are new processes (OpenMP's policy)
    res = json.loads((tmp_path / "threads_smoke.json").read_text())
    cores = available_cores()
    assert res["cores"] == cores
    got = {(r["processes"], r["threads"], r["policy"]) for r in res["rows"]}
    assert got == {(1, t, p) for t in {1, cores} for p in ("default", "PASSIVE")}  # smoke: one process
    (default,) = [r for r in res["rows"] if r["is_default"]]
    assert (default["threads"], default["policy"], default["vs_default"]) == (cores, "PASSIVE", 1.0)
    assert all(r["step_s"]["min"] > 0 and r["cpu_s_per_step"]["min"] > 0 for r in res["rows"])
    assert "megalite default" in (tmp_path / "threads_smoke.md").read_text()


def test_gdn_forms_smoke(tmp_path: Path) -> None:
    """The linear-attention benchmark in this process (CPU, fp32, two tiny lengths): every CPU form measured."""
    from bench.gdn_forms import main

    main(["--smoke", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "gdn_forms_smoke.json").read_text())
    assert [r["tokens"] for r in res["rows"]] == [32, 64]
    assert all(r[c] > 0 for r in res["rows"] for c in ("recurrent_ms", "chunked_ms", "attention_ms"))
    assert "| 64 |" in (tmp_path / "gdn_forms_smoke.md").read_text()
