"""The peak-memory model (megalite/perfmodel/peak_memory.py): its terms, how layouts and schedules move them, the
optimizer-state input, the tools that print it, and the measured peak of fresh runs against the prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megalite.perfmodel.estimate import Layout, ModelDims, Precision, estimate, stage_params
from megalite.perfmodel.peak_memory import CPU_CHECKPOINT_IMPORTS_BYTES, PeakOptions, peak_memory, stage_peak

REPO = Path(__file__).resolve().parents[1]
MID = ModelDims(num_layers=8, hidden_size=384, num_heads=6, vocab_size=2048, seq_len=256)
FP32 = Precision.for_dtype("fp32")


def test_terms_add_up_are_named_and_sit_above_the_floor() -> None:
    pk = peak_memory(MID, Layout(micro_batch_size=2, global_batch_size=4), FP32)
    names = [t.name for t in pk.terms()]
    assert names[:5] == ["baseline", "parameters", "gradients", "master weights", "optimizer states"]
    assert "activations" in names and names[-1] == "allocator slack" and all(t.formula or not t.bytes
                                                                               for t in pk.terms())
    assert pk.total == pytest.approx(sum(t.bytes for t in pk.terms()), rel=1e-12)
    floor = estimate(MID, Layout(micro_batch_size=2, global_batch_size=4), FP32).memory
    assert pk.model_states == floor.model_states  # the same ZeRO arithmetic: exact
    assert "GiB = " in pk.summary() and pk.peak_phase in pk.summary()
    assert pk.to_dict()["terms"]["baseline"] == pk.baseline.bytes


def test_schedules_zero_stages_and_cp_move_the_right_terms() -> None:
    lay = Layout(pp=2, micro_batch_size=1, global_batch_size=4)

    def term(pk_layout: Layout, rank: int, name: str, zero3_prefetch: int = 1, device: str = "cpu") -> float:
        pk = stage_peak(MID, pk_layout, FP32, rank, PeakOptions(device=device, zero3_prefetch=zero3_prefetch))
        return next(t.bytes for ts in (pk.states, *pk.phases.values()) for t in ts if t.name == name)

    one = term(lay, 0, "activations")
    assert term(lay, 1, "activations") < one  # 1F1B: stage r holds p - r micro-batches (+ the final norm's two)
    assert term(replace(lay, schedule="interleaved", vpp=2), 0, "activations") > one  # 1 + (p-1)/(pv) x 1F1B's
    assert term(replace(lay, schedule="zb-h1"), 1, "activations") > term(lay, 1, "activations")  # every rank p
    assert term(replace(lay, schedule="zb-h1"), 0, "deferred weight gradients") > 0
    assert term(lay, 0, "deferred weight gradients") == 0
    assert term(replace(lay, schedule="zbv", vpp=2), 0, "deferred weight gradients") > 0
    dp = Layout(dp=2, micro_batch_size=1, global_batch_size=8)
    states = [peak_memory(MID, replace(dp, zero=z), FP32).model_states for z in range(4)]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4
    assert term(replace(dp, zero=1), 0, "gradient buckets") == 0 < term(replace(dp, zero=2), 0, "gradient buckets")
    assert term(replace(dp, zero=2), 0, "ZeRO-3 gather buffers") == 0
    z3 = replace(dp, zero=3)
    block = stage_params(MID, 1, 1, 0).largest_layer * 4  # one more prefetched block per step of depth, fp32
    assert term(z3, 0, "ZeRO-3 gather buffers", 2) - term(z3, 0, "ZeRO-3 gather buffers", 1) == block
    # Every bucket's 1/N reduce-scatter output on either device; gloo's worker threads keep their parameter
    # all-gathers' staging on CPU (two buckets at most), NCCL has none.
    z1 = replace(dp, zero=1)
    assert term(z1, 0, "in-flight reduction", device="cuda") == term(z1, 0, "in-flight reduction") == (
        stage_params(MID, 1, 1, 0).total * 4 / 2)
    assert term(z1, 0, "gloo staging", device="cuda") == 0 == term(dp, 0, "gloo staging")
    assert term(z1, 0, "gloo staging") == min(stage_params(MID, 1, 1, 0).total, 2 * 25 * 2**20 / 4) * 4
    full = replace(dp, dp=1, recompute="full")
    assert term(full, 0, "recomputed block") > 0 and term(full, 0, "activations") < term(replace(full, recompute="none"),
                                                                                         0, "activations")
    assert term(Layout(cp=2), 0, "cp block-pair scores") > 0 == term(Layout(), 0, "cp block-pair scores")

    def base(pk_layout: Layout, device: str = "cpu") -> float:
        return stage_peak(MID, pk_layout, FP32, 0, PeakOptions(device=device)).baseline.bytes

    # torch.utils.checkpoint imports torch._dynamo (host pages): in the CPU baseline wherever recompute calls it.
    assert base(Layout(recompute="full")) == base(Layout(recompute="selective")) == (base(Layout())
                                                                                     + CPU_CHECKPOINT_IMPORTS_BYTES)
    assert base(Layout(cp=2, recompute="selective")) == base(Layout(cp=2))  # the ring's own blocks: no checkpoint
    assert base(Layout(cp=2, cp_mode="a2a", recompute="selective")) > base(Layout(cp=2, cp_mode="a2a"))
    assert base(Layout(recompute="full"), "cuda") == base(Layout(), "cuda")  # not in the device's memory


def test_optimizer_state_bytes_is_an_input() -> None:
    """An optimizer with one fp32 moment (Muon's momentum) passes 4 bytes per parameter instead of Adam's 8."""
    lay = Layout(dp=2, zero=1, micro_batch_size=1, global_batch_size=2)
    adam = peak_memory(MID, lay, FP32)
    muon = peak_memory(MID, lay, FP32, PeakOptions(optimizer_state_bytes=4, optimizer_temp_bytes=1 << 20))
    adam_states = next(t.bytes for t in adam.states if t.name == "optimizer states")
    assert next(t.bytes for t in muon.states if t.name == "optimizer states") == adam_states / 2
    assert muon.phases["step"][0].bytes == 1 << 20


def test_estimate_cli_prints_the_peak_terms(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.estimate import main

    assert main(["--preset", "llama-7b", "--dp", "8", "--zero", "1", "--memory-layout", "megalite"]) == 0
    text = capsys.readouterr().out
    assert "peak (size by this)" in text and "CUDA context" in text and "allocator slack" in text
    assert main(["--preset", "tiny", "--dtype", "fp32", "--memory-device", "cpu", "--json"]) == 0
    peak = json.loads(capsys.readouterr().out)["peak_memory"]
    assert peak["device"] == "cpu" and peak["terms"]["baseline"] > 0


# ------------------------------------------------------------------ measured: fresh processes

# Run in a fresh interpreter so the RSS high-water (VmHWM: a new address space's) is this run's alone. Transparent huge pages are switched off for
# the process (prctl PR_SET_THP_DISABLE) so the kernel's THP setting (always / madvise / never) cannot round RSS up
# by 2 MiB pages; the trainer's own glibc tuning (megalite/runtime/malloc.py: freed heap kept, 64 MiB mmap threshold)
# makes the heap's high-water the tensors' high-water, whatever the trim defaults are.
CHILD = """
import ctypes, json, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
from megalite.observability.metrics import peak_rss_bytes
from megalite.training.trainer import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "peak_rss_bytes": peak_rss_bytes()}))
"""
CASES = {
    # Full recompute: torch.utils.checkpoint imports torch._dynamo (CPU_CHECKPOINT_IMPORTS_BYTES), a fifth of the peak.
    "tiny": ["--model.preset", "tiny", "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
             "--model.recompute", "full"],
    "mid": ["--model.num_layers", "4", "--model.hidden_size", "384", "--model.num_heads", "6", "--model.seq_len", "256",
            "--train.micro_batch_size", "4", "--train.global_batch_size", "8"],
}


def test_measured_peak_rss_is_predicted(demo_cache_dir: str, tmp_path: Path) -> None:
    """Two fresh single-process runs (one baseline-dominated, with full recompute: torch._dynamo's pages, imported
    by torch.utils.checkpoint, are a fifth of it; one where states and activations are half of it), 2 steps each,
    side by side: each one's peak RSS (VmHWM, `peak_rss_bytes`: ru_maxrss would report this big test process's RSS,
    inherited over the fork) within [0.80, 1.15] of `predicted_peak` (tiny without the dynamo term: 0.79).

    The bound: bench/memory_peak.py holds 10% over its layouts; the rest is what the fixed baseline (interpreter +
    torch's pages, a constant measured with torch 2.13's CPU wheel) may differ by on another machine, build or
    environment: in a fresh CI virtual environment the baseline-dominated tiny run once measured 0.827 (556 MB
    against 462 predicted) where this machine's own environment gives 0.85-0.9, so the lower bound is 0.80. A
    missing model term (the dynamo pages: 0.79 on tiny) or a doubled one still fails. RSS does not depend on
    load or timing, so two runs at once cost no accuracy."""
    from megalite.config import parse_args, resolve
    from megalite.data import prepare_demo_data
    from megalite.training.memory_check import predicted_peak, tokenizer_vocab_size

    prepare_demo_data(demo_cache_dir, 300000, 512)  # once, before the children
    common = ["--data.cache_dir", demo_cache_dir, "--data.demo_max_bytes", "300000", "--data.demo_vocab_size", "512",
              "--train.device", "cpu", "--model.kernels", "torch", "--train.steps", "2", "--train.warmup_steps", "1",
              "--logging.interval", "1", "--train.eval_interval", "0"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    procs, predicted = {}, {}
    for name, flags in CASES.items():
        argv = [*common, *flags, "--logging.dir", str(tmp_path / name)]
        cfg = resolve(parse_args(argv), 1)
        cfg.model.vocab_size = tokenizer_vocab_size(cfg)
        predicted[name] = predicted_peak(cfg)
        procs[name] = subprocess.Popen([sys.executable, "-c", CHILD, *argv], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, cwd=str(REPO), env=env)
    for name, proc in procs.items():
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-2000:]
        measured = json.loads(out.strip().splitlines()[-1])
        assert measured["code"] == 0, err[-2000:]
        ratio = predicted[name].total / measured["peak_rss_bytes"]
        assert 0.80 <= ratio <= 1.15, (name, ratio, predicted[name].summary(8), measured)
    assert predicted["mid"].total - predicted["mid"].baseline.bytes > predicted["mid"].baseline.bytes / 2


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_expert_weights_are_counted_as_the_model_allocates_them(arch: str) -> None:
    """The parameter count behind the size check, the estimator and the check before step 1 (`count_model_params`,
    `stage_params` with `MoEDims`) equals a built MoE model's: routed experts, a router, shared experts and dense
    first layers (issue 44: a count blind to experts let moe_ffn_hidden_size 1e9 through to the allocator)."""
    from megalite.config import ModelArgs, parse_args, resolve
    from megalite.model.gpt import GPT
    from megalite.model.params import count_model_params
    from megalite.parallel.state import ParallelState
    from megalite.perfmodel.estimate import stage_params
    from megalite.training.memory_check import run_inputs

    cfg = resolve(parse_args(["--model.preset", "tiny-moe", "--model.arch", arch, "--model.num_layers", "3",
                              "--moe.shared_experts", "2", "--moe.shared_ffn_hidden_size", "96",
                              "--moe.first_dense", "1", "--model.vocab_size", "256"]), 1)
    if arch == "gpt2":
        cfg.model.num_kv_heads, cfg.model.tie_embeddings = cfg.model.num_heads, True
    built = sum(p.numel() for p in GPT(ModelArgs.from_config(cfg), ParallelState(), seed=0).parameters())
    dims, _ = run_inputs(cfg)
    assert count_model_params(ModelArgs.from_config(cfg)) == built == stage_params(dims, 1, 1, 0).total
    experts = stage_params(dims, 1, 1, 0).experts
    assert experts == 2 * 8 * (3 if arch == "llama" else 2) * 128 * 128  # 2 MoE layers x 8 experts x (3|2)·h·F
    assert stage_params(dims, 1, 1, 0, ep=2).experts == experts // 2  # split over ep


def test_fit_checks_count_experts_and_refuse_in_one_line() -> None:
    """Expert widths or shared-expert counts no machine holds: config validation refuses with one line (before
    anything is built), and a size the size check lets through is priced, experts included, by the check before
    step 1 (the same `predicted_peak` the tools print)."""
    import torch

    from megalite.config import parse_args, resolve, validate
    from megalite.errors import ConfigError
    from megalite.training.memory_check import check_memory_of, predicted_peak

    for flag in ("--moe.ffn_hidden_size", "--moe.shared_experts"):
        cfg = resolve(parse_args(["--model.preset", "tiny-moe", flag, "1000000000"]), 1)
        # Refused by the size check (weights beyond any memory) or, first, by the field's own bound (values.py).
        with pytest.raises(ConfigError, match=r"parameters: its fp32 weights alone are .* TiB per rank|far beyond "
                                              "any real model") as err:
            validate(cfg, 1, "cpu")
        assert "\n" not in str(err.value)
    small = resolve(parse_args(["--model.preset", "tiny-moe", "--model.vocab_size", "2048"]), 1)
    wide = resolve(parse_args(["--model.preset", "tiny-moe", "--model.vocab_size", "2048",
                               "--moe.ffn_hidden_size", "1000000"]), 1)
    extra = predicted_peak(wide).model_states - predicted_peak(small).model_states
    assert extra == pytest.approx(16 * 4 * 8 * 3 * 128 * (1_000_000 - 128))  # 16 B/param fp32 Adam, 4 layers x 8
    with pytest.raises(ConfigError, match="this run needs about") as err:
        check_memory_of(wide, torch.device("cpu"), 1, available=64 * 2**30)
    assert "\n" not in str(err.value)


def test_the_check_before_step_1_reads_the_whole_model_config() -> None:
    """`run_inputs` reads a run's model through `spec_dims`, as the MoE planner does: a head width set apart from
    hidden / heads (Qwen3's `model.head_dim`) is the one the attention terms are sized with."""
    from megalite.config import parse_args, resolve
    from megalite.training.memory_check import predicted_peak, run_inputs

    base = ["--model.preset", "tiny", "--model.vocab_size", "256"]
    plain, wide = (resolve(parse_args(base + extra), 1) for extra in ([], ["--model.head_dim", "64"]))
    assert run_inputs(plain)[0].hd == 32 and run_inputs(wide)[0].hd == 64
    assert predicted_peak(wide).total > predicted_peak(plain).total
