"""`model.compile`: each block's forward torch.compile'd trains like the eager single-process model at every layout.

Two kinds of check, to keep the seconds down (inductor's C++ compile on 2 cores costs tens of seconds per
model, dynamo + AOTAutograd tracing a few per layout):

- the layouts (tp2, tp2+sp, pp2 with GPipe / interleaved 1F1B, dp2 ZeRO 1-3, cp2, both recomputes) and the
  features (MoE at one rank per replica and across ep2, FP8 tensorwise and rowwise, document masking) in ONE
  2-rank spawn with the "aot_eager" backend: dynamo traces each block, AOTAutograd builds its joint
  forward/backward graph (the TP/SP region operators' autograd functions, the linears' `LinearParts` or FP8's
  `_scaled_mm` function, the masked SDPA, the checkpoint of selective recompute all inside it) and runs it
  with the eager kernels. So it proves what compile changes in megalite's wiring (hooks outside the graph,
  the gradient sync's hook path instead of the folds) without paying for code generation. Each case must
  trace with no graph break but the documented ones (the counted collectives where a block communicates, the
  MoE layer where there is one: docs/performance.md), and each of those where it belongs.
- inductor (the default backend, generated C++ kernels) once, at 1 process, through `pretrain.py`'s main.

Tolerances. aot_eager runs the same kernels as eager, but a weight gradient arrives as `.grad` + the sync's
`add_` instead of the fold's in-GEMM `addmm_` (the same sum rounded once more), and each layout sums in its
own order: the layout tests' bounds (tests/test_cp_training.py: 1e-5 on O(1) losses, 1e-5 relative on the
gradient norm, 1e-4 on parameters after 3 AdamW steps at lr 1e-2) hold. Inductor fuses the norms, softmax and
SwiGLU into loops that accumulate fp32 reductions in another order (vectorised partial sums): ~1e-6 relative
per reduction, a few hundred of them between the input and the loss of this 2-layer model, so the losses of
4 steps agree to 1e-4 absolute (observed: equal to print precision); a wrong graph (a dropped residual, a
stale weight) moves them by > 1e-2. FP8 cases use tests/test_fp8_training.py's bounds (its module doc: a value at
a rounding midpoint may round the other way after the first update).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn

from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.fp8.enable import enable_fp8, fp8_settings
from megalite.model.compile import compile_blocks, cpu_compiler
from megalite.model.gpt import GPT
from megalite.moe.layer import ROUTED_SHAPES
from megalite.optim import SyncOptions, build_distributed_optimizer
from megalite.parallel.comm import OUTSIDE_GRAPH
from megalite.parallel.param_spec import EXPERT_PARALLEL, named_param_specs
from megalite.parallel.sharding import unshard
from megalite.parallel.state import ParallelState
from megalite.pipeline import StagePlan, build_pipeline
from megalite.training.step import train_step
from megalite.training.trainer import main
from tests.moe_utils import moe_layout, tiny_moe_cfg
from tests.parallel_utils import (layout, micro_batches, random_steps, reference_optimizer, step_context,
                                  tiny_model_cfg, tiny_train_cfg)
from tests.parallel_utils import ADAMW
from tests.test_cp_training import LOSS_ATOL, MICRO, M, PARAM_ATOL, SEQ, STEPS, local_batches, problems
from tests.test_fp8_training import GRAD_RTOL as FP8_GRAD_RTOL
from tests.test_fp8_training import MIN_DIM as FP8_MIN_DIM
from tests.test_fp8_training import PARAM_MAX as FP8_PARAM_MAX
from tests.test_fp8_training import PARAM_MEAN as FP8_PARAM_MEAN
from tests.test_pretrain import _args, _losses

EOD = 0  # the document-masking cases' end-of-document token


class Case(NamedTuple):
    """One compiled layout at 2 ranks; the defaults are the plain dense llama at dp2."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    zero: int = 0
    arch: str = "llama"
    recompute: str = "none"
    schedule: str = "1f1b"
    vpp: int = 1
    moe_ep: int = 0          # 0: dense MLPs; else every FFN a MoE layer (4 experts, top-2, aux + z losses) at ep
    fp8: str | None = None   # fp8.recipe's recipe
    documents: bool = False  # data.document_mask: attention within documents, positions restarting
    steps: int = STEPS


CASES = [  # every parallel dimension, both recomputes, each pipeline schedule compile runs, and the features
    # (one case per feature: tracing each case, not its steps, is what costs here, ~2-8 CPU-s a rank)
    Case(tp=2, sp=True, arch="gpt2", recompute="selective"),
    Case(zero=1, arch="gpt2", moe_ep=1),  # MoE (GeLU experts), each rank its own replica: the 1-rank case
    Case(zero=3, recompute="full"),
    Case(cp=2),
    # Two steps are enough below: the second runs on parameters the first step's update moved.
    # pp2: the interleaved 1F1B schedule (vpp2) here, GPipe below; plain 1F1B runs the same compiled blocks.
    Case(pp=2, vpp=2, schedule="interleaved", steps=2),
    # GPipe, and document masking (the masked SDPA and per-document RoPE in the graph) through both stages; under
    # cp the document-masked attention is the ring's, outside the graph like cp2's above.
    Case(pp=2, schedule="gpipe", documents=True, steps=2),
    Case(moe_ep=2, zero=2, recompute="full", steps=2),          # MoE across ep2 (the all-to-all dispatch), ZeRO-2
    Case(fp8="tensorwise", tp=2, sp=True, steps=2),             # FP8: scales max-reduced over tp inside the linears
    Case(fp8="rowwise", tp=2, steps=2),                         # and plain tp (no sp)'s region operators
]


def _expected_breaks(c: Case) -> set[str]:
    """The documented graph breaks a case must show (docs/performance.md): the counted collectives where a
    block communicates (tp, cp), the MoE layer wherever there is one (its ep all-to-all runs inside it)."""
    return ({OUTSIDE_GRAPH} if c.tp > 1 or c.cp > 1 else set()) | ({ROUTED_SHAPES} if c.moe_ep else set())


def _reference(cfg, data: list[torch.Tensor], context: ContextOptions, fp8: str | None
               ) -> tuple[GPT, list[tuple[float, float]]]:
    """The eager single process (FP8 in the same linears when asked)."""
    st = ParallelState()
    ref = GPT(cfg, st, seed=5, context=context)
    enable_fp8([ref], fp8_settings(fp8 or "none", FP8_MIN_DIM), st)
    opt = reference_optimizer(ref, st)
    ctx = step_context(ref, st, torch.float32, tiny_train_cfg(len(data)))
    return ref, [(r.loss, r.grad_norm) for r in (train_step(ctx, opt, micro_batches(d, MICRO), i)
                                                 for i, d in enumerate(data))]


def _param_diffs(opt, st: ParallelState, chunks: list[nn.Module], ref: GPT) -> dict[str, torch.Tensor]:
    """|this rank's parameter - the reference's| per name, gathered over ZeRO shards and tp (an ep rank's experts
    are its block of the reference's); gpt2's key bias excluded (zero true gradient: tests/test_cp_training.py)."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    specs = {}
    for chunk in chunks:
        specs.update(named_param_specs(chunk, ConfigError))
    out = {}
    for name, value in opt.full_parameters().items():
        name = name.split(".", 1)[1] if name.split(".", 1)[0].isdigit() else name  # a ModuleList's chunk prefix
        got, want = unshard(value, specs[name].layout, st), ref_params[name].detach()
        if specs[name].grads == EXPERT_PARALLEL:
            n = want.shape[0] // st.size("ep")
            want = want[st.rank_in("ep") * n:(st.rank_in("ep") + 1) * n]
        if name.endswith("attn.qkv.bias"):
            h = got.shape[0] // 3
            got, want = torch.cat([got[:h], got[-h:]]), torch.cat([want[:h], want[-h:]])
        out[name] = (got - want).abs()
    return out


def _check_case(c: Case) -> None:
    from torch._dynamo.utils import counters  # what dynamo traced: graphs and graph breaks (test-only)

    what = str(c)
    torch.compiler.reset()
    counters.clear()
    st = moe_layout(c.tp, c.pp, c.cp, c.moe_ep, c.sp) if c.moe_ep > 1 else layout(c.tp, c.pp, sp=c.sp, cp=c.cp)
    make = tiny_moe_cfg if c.moe_ep else tiny_model_cfg  # pp2 x vpp2: one layer per chunk
    cfg = make(c.arch, seq_len=SEQ, recompute=c.recompute, num_layers=2 * c.pp)
    data = random_steps(cfg, c.steps, MICRO * M * st.dp)
    if c.documents:  # documents of random lengths: about one token in five ends one
        data = [torch.where(d % 5 == 0, EOD, d) for d in data]
    context = ContextOptions.of("ring", EOD if c.documents else None)
    ref, ref_results = _reference(cfg, data, context, c.fp8)
    engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32,
                            stages=StagePlan(vpp=c.vpp, schedule=c.schedule), context=context)
    chunks = list(engine.chunks)
    enable_fp8(chunks, fp8_settings(c.fp8 or "none", FP8_MIN_DIM), st)
    assert compile_blocks(chunks, "aot_eager") == sum(len(chunk.layers) for chunk in chunks)
    model = chunks[0] if c.vpp == 1 else nn.ModuleList(chunks)
    opt = build_distributed_optimizer(model, st, c.zero, dtype=torch.float32, optimizer=ADAMW,
                                      sync=SyncOptions(fold_weight_grads=False))
    ctx = step_context(engine, st, torch.float32, tiny_train_cfg(c.steps), c.schedule)
    results = [train_step(ctx, opt, local_batches(d, st), i) for i, d in enumerate(data)]
    for i, (got, (loss, norm)) in enumerate(zip(results, ref_results)):
        assert abs(got.loss - loss) <= LOSS_ATOL, f"{what}: step {i} loss {got.loss} != eager {loss}"
        # FP8: a value at a rounding midpoint may flip after the first update (tests/test_fp8_training.py).
        rtol = FP8_GRAD_RTOL if c.fp8 and i > 0 else 1e-5
        assert abs(got.grad_norm - norm) <= rtol * norm, f"{what}: step {i} grad norm {got.grad_norm} != {norm}"
    diffs = _param_diffs(opt, st, chunks, ref)
    worst = max(diffs, key=lambda k: diffs[k].max().item())
    mean = torch.cat([d.flatten() for d in diffs.values()]).mean().item()
    most, mean_bound = (FP8_PARAM_MAX, FP8_PARAM_MEAN) if c.fp8 else (PARAM_ATOL, 1.0)
    assert diffs[worst].max() <= most and mean <= mean_bound, \
        f"{what}: parameters off by {mean:.2e} on average, {worst} by {diffs[worst].max():.2e}"
    # The blocks really ran compiled.
    assert counters["stats"]["unique_graphs"] >= 1, f"{what}: nothing was compiled"
    # No graph break but the documented ones, each where it must be.
    reasons = list(counters["graph_break"])
    documented = {r for r in (OUTSIDE_GRAPH, ROUTED_SHAPES) if any(r in reason for reason in reasons)}
    assert all(any(r in reason for r in (OUTSIDE_GRAPH, ROUTED_SHAPES)) for reason in reasons), f"{what}: {reasons}"
    assert documented == _expected_breaks(c), f"{what}: graph breaks {reasons}"


def _check_compiled_layouts(rank: int) -> list[str]:
    seen = []
    for c in CASES:
        _check_case(c)
        seen.append(str(c))
    return seen


def test_compiled_blocks_train_like_eager_at_every_layout(dist_world) -> None:
    seen = dist_world(2).run(_check_compiled_layouts)
    assert seen[0] == seen[1] and len(seen[0]) == len(CASES)


@pytest.mark.skipif(cpu_compiler()[0] is None,
                    reason="inductor's CPU kernels need a C++ compiler (g++ not on PATH, CXX unset)")
def test_pretrain_with_inductor_matches_eager(demo_cache_dir: str, tmp_path: Path) -> None:
    """The default backend (inductor, C++ kernels on CPU) through pretrain.py: losses within 1e-4 of eager."""
    steps = ["--train.steps", "4"]
    assert main(_args(demo_cache_dir, tmp_path / "eager", *steps)) == 0
    assert main(_args(demo_cache_dir, tmp_path / "compiled", *steps, "--model.compile", "true")) == 0
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert eager.keys() == compiled.keys() and len(eager) == 4
    for step in eager:
        assert abs(eager[step] - compiled[step]) <= 1e-4, f"step {step}: compiled {compiled[step]} != {eager[step]}"


def test_compile_refuses_zero_bubble_and_unknown_backends() -> None:
    assert problems(2, "--model.compile", "true", "--parallel.tp", "2") == ""
    assert "nothing to defer to W" in problems(2, "--model.compile", "true", "--parallel.pp", "2",
                                                "--parallel.schedule", "zb-h1")
    assert "use one of inductor, aot_eager, eager" in problems(1, "--model.compile_backend", "cudagraphs")


def test_a_missing_cpp_compiler_is_one_config_line_before_step_1(monkeypatch: pytest.MonkeyPatch,
                                                                 demo_cache_dir: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Inductor's own search list (`cpp.cxx`, from CXX at import) pointing at a compiler that does not exist, or
    an empty PATH: config validation says so in one line, exit 2 (before: inductor's 111-line traceback at
    step 1). aot_eager needs no compiler."""
    from torch._inductor import config as inductor_config

    from tests.test_bad_inputs import assert_one_line

    # inductor's own patch, not monkeypatch: undoing a monkeypatch deletes the setting from torch's config
    # module (its attributes are not in __dict__), which broke every later inductor compile in the process.
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/bin/g++")}):
        assert "none of ['/nonexistent/bin/g++'] is an executable" in problems(1, "--model.compile", "true")
        assert problems(1, "--model.compile", "true", "--model.compile_backend", "aot_eager") == ""
    monkeypatch.setenv("PATH", "")
    with inductor_config.patch({"cpp.cxx": (None, "g++")}):
        got = main(_args(demo_cache_dir, tmp_path / "run", "--model.compile", "true"))
    assert_one_line(capsys.readouterr().err, got, 2, "none of ['g++'] is an executable")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_compile_keeps_parameter_names_and_hooks_eager() -> None:
    """compile_blocks shadows each block's forward only: names (so checkpoints) unchanged, module hooks run
    outside the graph (ZeRO-3's gather/free), and the same block object stays in the model."""
    from megalite.model.gpt import GPT
    from megalite.parallel.state import ParallelState

    model = GPT(tiny_model_cfg(), ParallelState(), seed=1)
    names = [n for n, _ in model.named_parameters()]
    calls: list[str] = []
    block = model.layers["0"]
    block.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    assert compile_blocks([model], "eager") == 2
    assert [n for n, _ in model.named_parameters()] == names and model.layers["0"] is block
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    assert calls == ["pre"]
    with pytest.raises(ValueError, match="compile_backend"):
        compile_blocks([nn.Module()], "nope")


def test_limit_benchmark_smoke(tmp_path: Path) -> None:
    """bench/limit.py can't rot: its smoke run (one tiny size, dynamo's eager backend, in this process) writes its
    table. bench/compile_compare.py is pretrain.py twice: the inductor test above covers that path."""
    import json

    from bench.limit import main as limit

    assert limit(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "limit_smoke.json").read_text())
    tiny = res["sizes"]["tiny"]
    assert res["meta"]["smoke"] and tiny["limit_gflops"]["median"] > 0
    assert {"megalite eager", "megalite compiled", "minimal torch loop"} <= tiny["fraction"].keys()
    assert all(f["median"] > 0 for f in tiny["fraction"].values())


def test_traced_fp8_gemms_have_the_layouts_inductor_lowers() -> None:
    """inductor's `_scaled_mm` lowering takes `a` row-major and `b` column-major only, on CPU too (torch 2.13):
    every traced FP8 GEMM of a linear, forward and backward, both recipes, gets them (megalite/fp8/scaled_mm.py).
    Checked on AOTAutograd's graphs, without inductor's C++ compile."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd  # test-only: a backend that inspects the graphs

    from megalite.fp8.costs import Splits
    from megalite.fp8.linear import Fp8Gemm

    layouts: list[tuple[bool, bool]] = []

    def record(gm: torch.fx.GraphModule, inputs: object):
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten._scaled_mm.default:
                a, b = node.args[0].meta["val"], node.args[1].meta["val"]
                layouts.append((a.stride(1) == 1, b.stride(0) == 1))
        return make_boxed_func(gm.forward)

    for recipe in ("tensorwise", "rowwise"):
        gemm = Fp8Gemm(recipe, Splits((), (), ()), ParallelState())  # type: ignore[arg-type]
        x, w = torch.randn(8, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
        torch.compiler.reset()
        linear = torch.compile(gemm.linear, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        linear(x, w).sum().backward()
    assert layouts == [(True, True)] * 6, layouts  # fprop, then dgrad and wgrad, per recipe
