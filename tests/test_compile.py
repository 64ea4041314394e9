"""`model.compile`: each block's forward torch.compile'd trains like the eager single-process model at every layout.

Two kinds of check, to keep the seconds down (inductor's C++ compile on 2 cores costs tens of seconds per
model, dynamo + AOTAutograd tracing a few per layout):

- the layouts (tp2, tp2+sp, pp2, dp2 ZeRO 1-3, cp2, both recomputes) in ONE 2-rank spawn with the
  "aot_eager" backend: dynamo traces each block, AOTAutograd builds its joint forward/backward graph (the
  TP/SP/cp region operators' autograd functions, the linears' `LinearParts`, the checkpoint of selective
  recompute all inside it) and runs it with the eager kernels. So it proves what compile changes in
  megalite's wiring (hooks outside the graph, collectives inside, the gradient sync's hook path instead of
  the folds) without paying for code generation. Each layout must trace with no graph break.
- inductor (the default backend, generated C++ kernels) once, at 1 process, through `pretrain.py`'s main.

Tolerances. aot_eager runs the same kernels as eager, but a weight gradient arrives as `.grad` + the sync's
`add_` instead of the fold's in-GEMM `addmm_` (the same sum rounded once more), and each layout sums in its
own order: the layout tests' bounds (tests/test_cp_training.py: 1e-5 on O(1) losses, 1e-5 relative on the
gradient norm, 1e-4 on parameters after 3 AdamW steps at lr 1e-2) hold. Inductor fuses the norms, softmax and
SwiGLU into loops that accumulate fp32 reductions in another order (vectorised partial sums): ~1e-6 relative
per reduction, a few hundred of them between the input and the loss of this 2-layer model, so the losses of
4 steps agree to 1e-4 absolute (observed: equal to print precision); a wrong graph (a dropped residual, a
stale weight) moves them by > 1e-2.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from megalite.model.compile import compile_blocks
from megalite.optim import build_distributed_optimizer
from megalite.parallel.comm import OUTSIDE_GRAPH
from megalite.pipeline import build_pipeline
from megalite.training.step import train_step
from megalite.training.trainer import main
from tests.parallel_utils import HYPER, layout, random_steps, step_context, tiny_model_cfg, tiny_train_cfg
from tests.test_cp_training import (LOSS_ATOL, MICRO, M, SEQ, STEPS, assert_params_match, local_batches, problems,
                                    reference_run)
from tests.test_pretrain import _args, _losses

LAYOUTS = [  # tp, pp, cp, sp, zero, arch, recompute: every parallel dimension and both recomputes at 2 ranks
    (2, 1, 1, False, 0, "llama", "none"),
    (2, 1, 1, True, 0, "gpt2", "selective"),
    (1, 2, 1, False, 0, "llama", "none"),
    (1, 1, 1, False, 1, "gpt2", "none"),
    (1, 1, 1, False, 2, "llama", "none"),
    (1, 1, 1, False, 3, "llama", "full"),
    (1, 1, 2, False, 0, "llama", "none"),
]


def _check_compiled_layouts(rank: int) -> list[str]:
    from torch._dynamo.utils import counters  # what dynamo traced: graphs and graph breaks (test-only)

    seen = []
    for tp, pp, cp, sp, zero, arch, recompute in LAYOUTS:
        what = f"tp={tp} pp={pp} cp={cp} sp={sp} zero={zero} {arch} recompute={recompute}"
        torch.compiler.reset()
        counters.clear()
        st = layout(tp, pp, sp=sp, cp=cp)
        cfg = tiny_model_cfg(arch, seq_len=SEQ, recompute=recompute, num_layers=2 * pp)
        data = random_steps(cfg, STEPS, MICRO * M * st.dp)
        ref, ref_results = reference_run(cfg, data)
        engine = build_pipeline(cfg, st, seed=5, micro_batch_size=MICRO, dtype=torch.float32)
        assert compile_blocks(engine.chunks, "aot_eager") == len(engine.chunks[0].layers)
        opt = build_distributed_optimizer(engine.chunks[0], st, zero, dtype=torch.float32, fold_weight_grads=False,
                                          **HYPER)
        tcfg = tiny_train_cfg(STEPS)
        results = [train_step(step_context(engine, st, torch.float32, tcfg), opt, local_batches(d, st), i)
                   for i, d in enumerate(data)]
        for i, (got, (loss, norm)) in enumerate(zip(results, ref_results)):
            assert abs(got.loss - loss) <= LOSS_ATOL, f"{what}: step {i} loss {got.loss} != eager {loss}"
            assert abs(got.grad_norm - norm) <= 1e-5 * norm, f"{what}: step {i} grad norm {got.grad_norm} != {norm}"
        assert_params_match(opt, st, list(engine.chunks), ref, what)
        # The blocks really ran compiled.
        assert counters["stats"]["unique_graphs"] >= 1, f"{what}: nothing was compiled"
        # No graph break but the documented one (`megalite.parallel.comm`: each counted collective runs between
        # graphs), and that one only where a block communicates: tp and cp.
        breaks = dict(counters["graph_break"])
        assert all(OUTSIDE_GRAPH in reason for reason in breaks), f"{what}: graph breaks {breaks}"
        assert bool(breaks) == (tp > 1 or cp > 1), f"{what}: graph breaks {breaks}"
        seen.append(what)
    return seen


def test_compiled_blocks_train_like_eager_at_every_layout(dist_world) -> None:
    seen = dist_world(2).run(_check_compiled_layouts)
    assert seen[0] == seen[1] and len(seen[0]) == len(LAYOUTS)


@pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("g++")),
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
