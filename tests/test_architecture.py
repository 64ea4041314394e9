"""The package's shape stays readable: the layers import downwards only (`LAYERS`), no import cycle between
modules (TYPE_CHECKING imports count: a reader follows them too), files stay focused, and every package is
installed."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megalite"


# The dependency direction, lowest layer first: a module imports modules of its own unit (a subpackage of
# megalite, or one of `SUBUNITS`) and of lower layers only. Layers 1-5 are the core a learner reads
# (docs/architecture.md); everything after them uses the core and the core never uses it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("megalite", "errors", "torch_private", "kernels"),  # base: root, error kinds, private torch calls, Triton
    ("atomic", "untrusted", "section"),           # base: atomic writes; bounded JSON/TOML reading; config fields
    ("parallel",),                                # core: the rank grid, counted collectives, RNG, ParamSpec
    ("attention",),                               # core: attention variants (window, sinks, soft-cap) and their math
    ("layers", "context"),                        # core: TP linears / embedding / loss; context parallelism
    ("recurrent",),                               # core: the gated delta-rule engine and the Gated DeltaNet layer
    ("fp8",),                                     # core: FP8 GEMMs of the linears and the expert GEMMs
    ("moe", "mla"),                               # core: mixture-of-experts layers; multi-head latent attention
    ("mtp",),                                     # core: multi-token prediction modules (their block is passed in)
    ("model", "dp"),                              # core: the GPT; gradient sync and ZeRO (wraps a model it never imports)
    ("optim",),                                   # core: the optimizers' maths on the shards dp hands over
    ("pipeline",),                                # core: stages, schedules, the p2p engine
    ("training.step",),                           # core: one optimizer step
    ("observability", "runtime"),                 # what the loop reports through; the process around it
    ("config",),                                  # the typed config, its parsing and validation
    ("data", "perfmodel"),                        # the data pipeline; the analytic model
    ("checkpoint",),                              # megalite's checkpoints: sharded, resharded, async
    ("checkpoint.interop",),                      # other formats: Hugging Face, DCP, torchtitan, Megatron
    ("inference",),                               # generation from a model or a checkpoint
    ("training",),                                # the loop behind pretrain.py
    ("tools", "bench", "pretrain"),               # outside the package: entry points and benchmarks
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[0] == "kernels":  # installed as megalite.kernels
        parts = ("megalite",) + parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Parts of a subpackage on a layer of their own: one optimizer step (the core) below the loop around it, and
# the other frameworks' formats above megalite's own checkpoints (which never import them).
SUBUNITS = ("training.step", "checkpoint.interop")


def _unit(module: str) -> str:
    """megalite.parallel.state -> parallel; megalite.training.step -> training.step; tools.x -> tools."""
    parts = module.split(".")
    if parts[0] != "megalite":
        return parts[0]
    if ".".join(parts[1:3]) in SUBUNITS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "megalite"


def _sources(*folders: str) -> dict[str, Path]:
    """Module name -> file, for the folders named ('pretrain' names the entry point)."""
    paths = [p for f in folders if f != "pretrain" for p in (REPO / f).rglob("*.py")]
    paths += [REPO / "pretrain.py"] if "pretrain" in folders else []
    return {_module_name(p): p for p in paths}


def _import_graph(*folders: str) -> dict[str, set[str]]:
    """Module -> the megalite modules it imports (`from pkg import submodule` names the submodule), over the
    modules of `folders` (default: the package and kernels/)."""
    modules = _sources(*(folders or ("megalite", "kernels")))
    known = set(modules) | set(_sources("megalite", "kernels"))
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            # A package importing its own submodules (its __init__ re-exporting them) is not a cycle, and
            # `from megalite import kernels` names the root only on the way to its submodule.
            graph[name] |= {t for t in targets if t in known and t not in (name, "megalite")
                            and not t.startswith(name + ".")}
    return graph


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module of another unit on the same or a higher layer (a unit missing from
    `LAYERS` counts as the highest, so a new folder must be placed before it may be imported)."""
    top = len(LAYERS)
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if _unit(t) != _unit(m) and LAYER_OF.get(_unit(t), top) >= LAYER_OF.get(_unit(m), top))


def test_the_layers_import_downwards_only() -> None:
    assert _upward_imports(_import_graph()) == []
    assert _upward_imports(_import_graph("tools", "bench", "pretrain")) == []


def test_every_package_folder_has_a_layer() -> None:
    units = {_unit(m) for m in _sources("megalite", "kernels")}
    assert units <= set(LAYER_OF), units - set(LAYER_OF)


def test_the_layer_check_can_fail() -> None:
    graph = {"megalite.parallel.state": {"megalite.model.gpt"}, "megalite.model.gpt": {"megalite.parallel.state"},
             "megalite.dp.grad_sync": {"megalite.model.block"},
             "megalite.dp.shards": {"megalite.optim.zero"}, "megalite.training.step": {"megalite.training.trainer"},
             "megalite.training.trainer": {"megalite.training.step"}, "megalite.data.x": {"megalite.new.y"}}
    assert _upward_imports(graph) == ["megalite.data.x -> megalite.new.y", "megalite.dp.grad_sync -> megalite.model.block",
                                      "megalite.dp.shards -> megalite.optim.zero",
                                      "megalite.parallel.state -> megalite.model.gpt",
                                      "megalite.training.step -> megalite.training.trainer"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+; the check is the same on any")
def test_every_package_is_installed() -> None:
    """pyproject lists the packages by name (megalite.kernels comes from another folder): a new subpackage
    must be listed there, or a non-editable install would lack it."""
    import tomllib
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == {_module_name(p.parent / "__init__.py") for p in PACKAGE.rglob("__init__.py")} | {"megalite.kernels"}
    # kernels/ is megalite.kernels through its body module (megalite/__init__.py): never a regular package.
    assert (REPO / "kernels" / "_package.py").is_file() and not (REPO / "kernels" / "__init__.py").exists()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package() -> None:
    assert _cycles(_import_graph()) == []


def test_the_cycle_check_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_files_stay_focused() -> None:
    """One concept per file: nothing in megalite/ grows past ~400 lines without being split."""
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 420}
    assert not long, long


def test_the_cost_formulas_load_without_torch() -> None:
    """Each feature owns its closed-form costs (context/costs.py, moe/costs.py) and the cost model imports them
    rather than restating them: importing them, and the estimator's cp part, loads no torch."""
    import subprocess

    code = ("import sys, megalite.context.costs, megalite.moe.costs, megalite.perfmodel.context; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
# At most 8 parameters (self/cls not counted): a reader holds about seven things at once (Miller 1956), and a
# call beyond that is read by looking each argument up, not at a glance; the 16-parameter optimizer builder
# this replaced let a swapped pair of floats pass unnoticed. Past 8, the arguments that belong together go into
# the dataclass that names them (a config section, a layout, a shape). Triton kernels (kernels/) are exempt:
# a JIT kernel takes every pointer, stride and block size as a parameter.
MAX_PARAMETERS = 8


def _too_many_parameters(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            if count > MAX_PARAMETERS:
                out.append(f"{where}:{node.lineno} {node.name} takes {count}")
    return out


def test_no_function_takes_more_than_8_parameters() -> None:
    paths = [p for folder in ("megalite", "tools") for p in (REPO / folder).rglob("*.py")]
    found = [f for p in paths for f in _too_many_parameters(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert found == [], found


def test_the_parameter_check_can_fail() -> None:
    nine = "def f(a, b, c, d, e, f, g, h, i): pass\nclass C:\n    def m(self, a, b, c, d, e, f, g, h): pass\n"
    assert _too_many_parameters(nine, "x.py") == ["x.py:1 f takes 9"]  # self is not counted: m takes 8


def test_the_read_order_counts_are_this_trees() -> None:
    """docs/architecture.md gives each core file's line count (`path` (N)): they stay true."""
    import re
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Reading the core"):doc.index("## The rank grid")]
    cited = re.findall(r"`((?:megalite/)?[a-z_]+/[a-z_0-9]+\.py)`\s+\((\d+)\)", section)  # \s+: an entry may wrap
    assert len(cited) > 30  # the whole read order, not a few files
    stale = [(path, int(n), len(open(REPO / (path if path.startswith("megalite/") else f"megalite/{path}"),
                                    encoding="utf-8").read().splitlines()))
             for path, n in cited]
    assert [s for s in stale if s[1] != s[2]] == []
