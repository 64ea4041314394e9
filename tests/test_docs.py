"""The README and --help agree with the code: every config field is documented, CI runs the README's command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megalite.config import Config

REPO = Path(__file__).resolve().parents[1]


def test_config_reference_documents_every_config_field() -> None:
    readme = (REPO / "docs" / "config.md").read_text()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else type(getattr(Config(), section.name))):
            assert f"--{section.name}.{f.name} " in readme, f"docs/config.md lacks {section.name}.{f.name}"


def test_config_reference_is_the_help_text_and_lists_every_old_name() -> None:
    from megalite.config import help_text
    from megalite.config.aliases import RENAMED

    doc = (REPO / "docs" / "config.md").read_text()
    block = doc[doc.index("```text\n") + len("```text\n"):doc.index("```", doc.index("```text\n") + 3)]
    text = help_text()
    assert block == text[text.index("[model]"):], "docs/config.md is stale: paste `python pretrain.py --help` there"
    assert all(f"| `{old}` | `{new}` |" in doc for old, new in RENAMED.items()), "docs/config.md: renamed fields"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && python -m pytest' in readme
    assert "torch==2.13.0" in ci and 'pip install --quiet -e ".[test]"' in ci and "python -m pytest" in ci
    assert ci.index("torch==2.13.0") < ci.index('-e ".[test]"')  # torch first, or pip may pick a CUDA build


def test_shipped_configs_are_valid() -> None:
    from megalite.config import parse_args, resolve, validate

    configs = sorted((REPO / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        validate(resolve(parse_args(["--config", str(path)]), 1), 1, "cpu")


def _layout_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def test_readme_layout_lists_every_folder() -> None:
    """The Layout section names each top-level folder and each megalite/ subpackage, and nothing else."""
    names = set()
    for line in _layout_block().splitlines():
        word = line.strip().split(" ")[0] if line.strip() else ""
        if word.endswith("/"):
            names.add(word.rstrip("/"))
    top = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")
           and (REPO / ".git").exists() and _tracked(p)}
    sub = {p.name for p in (REPO / "megalite").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top | sub | {"megalite"} == names, f"README Layout vs tree: {sorted(names ^ (top | sub))}"


def _tracked(path: Path) -> bool:
    import subprocess

    out = subprocess.run(["git", "ls-files", str(path.relative_to(REPO))], cwd=REPO, capture_output=True, text=True)
    return bool(out.stdout.strip())


def test_readme_links_resolve() -> None:
    import re

    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
