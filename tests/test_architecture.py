"""The package's shape stays readable: no import cycle between modules (TYPE_CHECKING imports count: a
reader follows them too), files stay focused, and the code cites only what its users have."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megalite"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the megalite modules it imports (`from pkg import submodule` names the submodule)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            # A package importing its own submodules (its __init__ re-exporting them) is not a cycle.
            graph[name] |= {t for t in targets if t in modules and t != name and not t.startswith(name + ".")}
    return graph


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


def test_code_and_docs_cite_only_what_users_have() -> None:
    pattern = re.compile(r"seed\s+lecture|DESIGN\s+(principle|section)|\.\.[/]shared|the seed's", re.IGNORECASE)
    files = [*REPO.glob("*.md"), *(REPO / "docs").glob("*.md"), *PACKAGE.rglob("*.py"),
             *(REPO / "tools").glob("*.py"), *(REPO / "kernels").glob("*.py"), *(REPO / "bench").glob("*.py")]
    hits = [f"{p.relative_to(REPO)}:{i}" for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
