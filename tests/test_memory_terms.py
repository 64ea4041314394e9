"""The peak-memory model's terms against the tensors the code really allocates (no RSS, no allocator): the
parameters a rank holds (`stage_params`, the states' Ψ) and the bytes one block saves for its backward
(`layer_activation_bytes`, + `moe_layer_extra_bytes` for a MoE block), counted with autograd's saved-tensor hooks
on a small model: llama, gpt2, selective and full recompute, FP8 (both recipes), MoE (with and without shared
experts) at one process, tp 2 with and without sequence parallelism, and cp in every mode (ring, all-gather and
all-to-all at cp 2, hybrid at cp 4); and ZeRO-1/2/3's transient buffers at dp 2 (the reduce-scatter outputs, the
full gradient buckets, ZeRO-3's fixed gather buffers) against the gradient sync's own. The model states (parameters,
gradients, master weights, optimizer states at every ZeRO stage, tp, pp) are held equal to the optimizer's own
tensors by tests/test_estimate_vs_measured.py. What
the allocator adds on top (the heap's extent over its live bytes) is measured, not tested: bench/memory_peak.py."""

from __future__ import annotations

import pytest
import torch

from torch.utils.checkpoint import checkpoint

from megalite.config import ModelArgs, parse_args, resolve
from megalite.context.options import ContextOptions
from megalite.fp8.enable import enable_fp8, fp8_settings
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from megalite.perfmodel.estimate import stage_params
from megalite.perfmodel.saved_bytes import layer_activation_bytes, moe_layer_extra_bytes
from megalite.training.memory_check import run_inputs, run_precision
from tests.parallel_utils import layout

SMALL = ["--model.preset", "tiny", "--model.vocab_size", "250", "--model.seq_len", "64",
         "--train.micro_batch_size", "2"]


def _config(tp: int, sp: bool, extra: list[str], world: int | None = None):
    argv = [*SMALL, "--parallel.tp", str(tp), "--parallel.sp", str(sp).lower(), *extra]
    return resolve(parse_args(argv), world or tp)


def _measure(cfg, state: ParallelState) -> tuple[int, int, int]:
    """(parameter elements on this rank, bytes the first block saves for its backward: every saved tensor's
    storage once, the model's own parameters and buffers left out, the block's FP8 linears)."""
    par = cfg.parallel
    model = GPT(ModelArgs.from_config(cfg), state, seed=0, context=ContextOptions.of(par.cp_mode, None, par.cp_a2a))
    chosen = enable_fp8([model], fp8_settings(cfg.fp8.recipe, cfg.fp8.min_dim), state)
    in_block = [n for n in chosen if n.startswith(f"layers.{next(iter(model.layers))}.")]
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, torch.UntypedStorage] = {}  # held, so no saved storage's address is reused while counting

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = storage
        return t

    b, s = cfg.train.micro_batch_size, cfg.model.seq_len // state.cp // (state.tp if state.sp else 1)
    x = torch.randn(b, s, cfg.model.hidden_size, requires_grad=True)
    block = next(iter(model.layers.values()))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if cfg.model.recompute == "full":  # as GPT.forward runs it: the block's input is all it keeps
            checkpoint(model._replayable(block), x, model.cos, model.sin, None, use_reentrant=False)
        else:
            block(x, model.cos, model.sin, None)
    return sum(p.numel() for p in model.parameters()), sum(st.nbytes() for st in saved.values()), len(in_block)


def _check(cfg, state: ParallelState) -> None:
    params, saved, fp8_linears = _measure(cfg, state)
    dims, lay = run_inputs(cfg)
    assert params == stage_params(dims, lay.tp, 1, 0).total  # exact: every weight, the padded vocabulary's rows
    fp8 = None if cfg.fp8.recipe == "none" else (cfg.fp8.recipe, cfg.fp8.min_dim)
    prec = run_precision(torch.float32)
    expected = layer_activation_bytes(dims, lay, prec, fp8) + moe_layer_extra_bytes(dims, lay, prec)
    # exact: every saved tensor named by the formula (docs/estimator.md#peak-memory); a tensorwise FP8 linear also
    # saves its input's fp32 scale (4 bytes), which the formula leaves out
    assert saved == expected + (4 * fp8_linears if cfg.fp8.recipe == "tensorwise" else 0), (saved, expected)
    assert cfg.fp8.recipe == "none" or fp8_linears >= 3  # out, up and down are FP8 here (qkv's kv part is 64 wide)


@pytest.mark.parametrize("extra", [[], ["--model.arch", "gpt2", "--model.num_kv_heads", "0"],
                                   ["--model.recompute", "selective"], ["--model.recompute", "full"],
                                   ["--fp8.recipe", "tensorwise"],
                                   ["--fp8.recipe", "rowwise"], ["--model.preset", "tiny-moe"],
                                   ["--model.preset", "tiny-moe", "--moe.shared_experts", "1"]],
                         ids=["llama", "gpt2", "selective", "full", "fp8-tensorwise", "fp8-rowwise", "moe", "moe-shared"])
def test_one_process_terms_are_the_allocated_tensors(extra: list[str]) -> None:
    _check(_config(1, False, extra), ParallelState())


def _tp_rank(rank: int, sp: bool, extra: list[str]) -> None:
    _check(_config(2, sp, extra), layout(2, sp=sp))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_terms_are_the_allocated_tensors(dist_world, sp: bool) -> None:
    """What tp divides and what it does not (the norms' weights, RoPE's tables, the gathered inputs of the
    column-parallel linears, under SP the sequence-local norms): each rank's own tensors."""
    dist_world(2).run(_tp_rank, sp, [])
    dist_world(2).run(_tp_rank, sp, ["--model.arch", "gpt2", "--model.num_kv_heads", "0"])


def _cp_rank(rank: int, cp: int, extra: list[str]) -> None:
    _check(_config(1, False, ["--parallel.cp", str(cp), *extra], world=cp), layout(1, cp=cp))


@pytest.mark.parametrize("cp,mode", [(2, ["ring"]), (2, ["allgather"]), (2, ["a2a"]), (4, ["hybrid", "2"])],
                         ids=["ring", "allgather", "a2a", "hybrid"])
def test_context_parallel_terms_are_the_allocated_tensors(dist_world, cp: int, mode: list[str]) -> None:
    """Every saved tensor of S/cp tokens and RoPE's tables of this rank's positions, plus what each cp mode keeps
    beyond them (`cp_saved_bytes`: the all-gather's gathered K/V, the all-to-all's output before it is sent back,
    their int64 positions)."""
    extra = ["--parallel.cp_mode", mode[0]] + (["--parallel.cp_a2a", mode[1]] if len(mode) > 1 else [])
    dist_world(cp).run(_cp_rank, cp, extra)


def _zero_rank(rank: int, zero: int) -> dict[str, float]:
    """One ZeRO step at dp 2: the full gradient buckets and reduce-scatter outputs alive at the end of the backward
    (when the step's sync starts), and ZeRO-3's gather buffers after the step (every one given back)."""
    from megalite.optim import build_distributed_optimizer
    from megalite.pipeline import build_pipeline
    from megalite.training.step import train_step
    from tests.parallel_utils import ADAMW, step_context, tiny_model_cfg, tiny_train_cfg

    st = layout(1, dp=2)
    engine = build_pipeline(tiny_model_cfg("llama", num_layers=4), st, seed=1, micro_batch_size=2, dtype=torch.float32)
    opt = build_distributed_optimizer(engine.chunks[0], st, zero, torch.float32, optimizer=ADAMW)
    seen: dict[str, float] = {}
    finish = opt.finish_grad_sync

    def at_the_end_of_the_backward() -> None:
        seen["buckets"] = sum(b.grad_flat.numel() * 4 for b in opt.sync.buckets if b.grad_flat is not None)
        seen["outputs"] = sum(b.scatter_out.numel() * 4 for b in opt.sync.buckets if b.scatter_out is not None)
        finish()

    opt.finish_grad_sync = at_the_end_of_the_backward  # type: ignore[method-assign]
    data = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    train_step(step_context(engine, st, torch.float32, tiny_train_cfg(2)), opt, [(data[:, :-1], data[:, 1:])], 0)
    zero3 = opt.sync.zero3
    seen["gathers"] = 0.0 if zero3 is None else zero3.buffers.idle_bytes()
    seen["padding"] = 4 * 2 * len(opt.sync.buckets)  # each bucket padded to a multiple of dp: < dp elements
    return seen


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_buffers_are_the_allocated_tensors(dist_world, zero: int) -> None:
    """The ZeRO terms of the peak against the tensors the gradient sync holds: every bucket's 1/N reduce-scatter
    output ("in-flight reduction", ZeRO >= 1), its full fp32 gradient at ZeRO-2/3 ("gradient buckets": at ZeRO-1
    it is the persistent "gradients" state), and ZeRO-3's fixed gather buffers, the largest block's twice
    (computing and prefetched) and the outer unit's ("ZeRO-3 gather buffers")."""
    from megalite.perfmodel.estimate import Layout, ModelDims, Precision
    from megalite.perfmodel.peak_memory import PeakOptions, stage_peak
    from tests.parallel_utils import tiny_model_cfg

    out = dist_world(2).run(_zero_rank, zero)
    cfg = tiny_model_cfg("llama", num_layers=4)
    dims = ModelDims(num_layers=4, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, vocab_size=cfg.vocab_size,
                     seq_len=cfg.seq_len, arch="llama", num_kv_heads=cfg.num_kv_heads,
                     ffn_hidden_size=cfg.ffn_hidden_size, tie_embeddings=False,
                     make_vocab_divisible_by=cfg.make_vocab_divisible_by)
    lay = Layout(dp=2, zero=zero, micro_batch_size=2, global_batch_size=4)
    pk = stage_peak(dims, lay, Precision.for_dtype("fp32"), 0, PeakOptions(device="cuda"))
    terms = {t.name: t.bytes for ts in (pk.states, *pk.phases.values()) for t in ts}
    for r in out:
        # exact but for each bucket's padding to a multiple of dp (fewer than dp elements)
        assert 0 <= r["outputs"] - terms["in-flight reduction"] <= r["padding"] / 2
        assert 0 <= r["buckets"] - terms["gradient buckets" if zero >= 2 else "gradients"] <= r["padding"]
        assert r["gathers"] == terms["ZeRO-3 gather buffers"]
