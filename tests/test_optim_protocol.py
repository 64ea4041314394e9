"""The optimizer contract (`megalite.optim.protocol`): both optimizers implement it member for member,
every user is typed with it, and the optimizer and gradient-sync packages have no import cycle."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from megalite.checkpoint import sharded
from megalite.dp.grad_sync import FoldsWeightGrad
from megalite.errors import ConfigError
from megalite.model.gpt import GPT
from megalite.optim import build_distributed_optimizer
from megalite.optim.protocol import DistributedOptimizer
from megalite.optim.reference import ReferenceOptimizer
from megalite.optim.zero import ZeroOptimizer
from megalite.parallel.state import ParallelState
from megalite.parallel.units import MadeOfUnits
from megalite.pipeline.engine import BackwardSync, PipelineEngine
from megalite.training.step import train_step
from tests.parallel_utils import ADAMW, reference_optimizer, tiny_model_cfg

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = sorted(n for n in vars(DistributedOptimizer) if not n.startswith("_"))


def _optimizers() -> list[object]:
    st = ParallelState()
    ref = reference_optimizer(GPT(tiny_model_cfg("gpt2"), st, seed=1), st, lr=1e-3)
    zero = build_distributed_optimizer(GPT(tiny_model_cfg("llama"), st, seed=1), st, 0, torch.float32, optimizer=ADAMW)
    return [ref, zero]


def test_protocol_lists_what_the_step_engine_and_checkpoint_use() -> None:
    assert MEMBERS == sorted(["stage", "zero_grad", "no_sync", "defer_weight_grads", "finish_grad_sync",
                              "scale_grads", "grad_norm",
                              "step", "finish_param_sync", "gathered", "param_states", "load_param_states",
                              "memory_bytes"])


def test_both_optimizers_satisfy_the_protocol() -> None:
    for opt in _optimizers():
        assert isinstance(opt, DistributedOptimizer), type(opt).__name__
        assert isinstance(opt.stage, int)  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", [ReferenceOptimizer, ZeroOptimizer])
@pytest.mark.parametrize("member", [m for m in MEMBERS if m != "stage"])
def test_every_member_has_the_protocol_signature(cls: type, member: str) -> None:
    """Same parameter names, kinds and defaults, and the same resolved annotations (return type too)."""
    want, got = getattr(DistributedOptimizer, member), getattr(cls, member, None)
    assert callable(got), f"{cls.__name__} has no method {member}"
    sig_want, sig_got = inspect.signature(want), inspect.signature(got)
    shape = [(p.name, p.kind, p.default) for p in sig_want.parameters.values()]
    assert [(p.name, p.kind, p.default) for p in sig_got.parameters.values()] == shape, f"{cls.__name__}.{member}"
    assert typing.get_type_hints(got) == typing.get_type_hints(want), f"{cls.__name__}.{member} annotations"


def test_a_method_missing_from_an_optimizer_fails_the_check() -> None:
    """The isinstance check above can fail: an object lacking one member is not a DistributedOptimizer."""

    class Incomplete(ReferenceOptimizer):
        grad_norm = None  # type: ignore[assignment]

    opt = _optimizers()[0]
    opt.__class__ = Incomplete
    assert not isinstance(opt, DistributedOptimizer)


def test_every_user_is_typed_with_the_protocol() -> None:
    assert typing.get_type_hints(train_step)["optimizer"] is DistributedOptimizer
    optional = DistributedOptimizer | None
    # The engine needs only the backward side, as a protocol of its own that both optimizers satisfy.
    assert typing.get_type_hints(PipelineEngine.run)["optimizer"] == BackwardSync | None
    assert all(callable(getattr(opt, m, None)) for opt in _optimizers() for m in ("no_sync", "defer_weight_grads"))
    assert typing.get_type_hints(sharded.save_sharded)["optimizer"] == optional
    assert typing.get_type_hints(sharded.load_sharded)["optimizer"] == optional


def test_the_model_side_contracts() -> None:
    """A GPT stage names the units it is made of (its blocks, in order); its linears take a weight-grad fold."""
    model = GPT(tiny_model_cfg("llama"), ParallelState(), seed=1)
    assert isinstance(model, MadeOfUnits)
    assert model.units() == list(model.layers.values())
    folds = {n for n, m in model.named_modules() if isinstance(m, FoldsWeightGrad)}
    assert folds == {"head"} | {f"layers.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.out", "mlp.up",
                                                                                "mlp.down")}


def test_zero3_refuses_a_model_that_names_no_units() -> None:
    """Several interleaved chunks (an nn.ModuleList) are not one `MadeOfUnits` model: a config error, before
    any process group is touched (dp=2 on one process is enough to reach the check)."""
    st = ParallelState(dp=2, rank=0)
    chunks = nn.ModuleList([GPT(tiny_model_cfg("llama"), st, seed=1, layers=range(0, 1), post_process=False),
                            GPT(tiny_model_cfg("llama"), st, seed=1, layers=range(1, 2), pre_process=False)])
    assert not isinstance(chunks, MadeOfUnits)
    with pytest.raises(ConfigError, match="several model chunks"):
        build_distributed_optimizer(chunks, st, 3, torch.float32, optimizer=ADAMW)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every megalite module `path` imports, anywhere in the file (TYPE_CHECKING blocks included: a
    reader follows those too); `from package import submodule` counts as importing the submodule."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out & modules


def test_no_import_cycle_through_the_optimizer_package() -> None:
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "megalite").rglob("*.py")}
    graph = {m: _imports(p, set(modules)) - {m} for m, p in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            for n in graph[m]:
                if n == goal:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    optim = [m for m in modules if m.startswith(("megalite.optim.", "megalite.dp."))]
    assert "megalite.optim.zero" not in graph["megalite.dp.zero_state"]
    # The two halves of the ZeRO optimizer meet only in `dp.shards` (and `optim.zero`, which composes them),
    # and the gradient sync's package imports no optimizer.
    assert not {m for m in modules if m.startswith("megalite.dp.") for n in graph[m] if n.startswith("megalite.optim")}
    assert not {"megalite.dp.grad_sync", "megalite.dp.buckets"} & graph["megalite.optim.shard_adamw"]
    # Neither the engine nor the layers import an optimizer or the gradient sync.
    for user in ("megalite.pipeline.engine", "megalite.layers.linear_fn", "megalite.layers.linear"):
        assert not {m for m in graph[user] if m.startswith(("megalite.optim", "megalite.dp"))}, user
    # The training step drives the protocol and knows neither concrete optimizer nor the gradient sync.
    concrete = {"megalite.optim", "megalite.optim.zero", "megalite.optim.reference", "megalite.optim.shard_adamw",
                "megalite.optim.muon"}
    assert not {m for m in graph["megalite.training.step"] if m in concrete or m.startswith("megalite.dp")}
    cycles = [m for m in optim if reaches(m, m)]
    assert not cycles, f"import cycles through {cycles}"
