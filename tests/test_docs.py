"""The README and --help agree with the code: every config field is documented, CI runs the README's command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megalite.config import Config

REPO = Path(__file__).resolve().parents[1]


def test_readme_documents_every_config_field() -> None:
    readme = (REPO / "README.md").read_text()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else type(getattr(Config(), section.name))):
            assert f"--{section.name}.{f.name} " in readme, f"README config reference lacks {section.name}.{f.name}"


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
