"""No name the checkout exposes shadows an installed distribution, and transformers works beside megalite from
the checkout root (where `python -m pytest`, `python -c` and notebooks put the root first on `sys.path`).

transformers 5.x imports PyPI's `kernels` package; a top-level `kernels/` regular package in the checkout used
to shadow it there (megalite/__init__.py says how the folder is loaded now)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import torch

from megalite.checkpoint.sharded import save_sharded
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.parallel_utils import tiny_model_cfg
from tools.export_hf import main as export_main

REPO = Path(__file__).resolve().parents[1]
# The folders that land first on sys.path: the root (python -m, pytest's rootdir insertion, a REPL there) and
# each script folder (`python tools/x.py` puts tools/ first).
PATH_ROOTS = (REPO, REPO / "tools", REPO / "bench")


def exposed_names(folder: Path) -> set[str]:
    """The top-level import names `folder` provides when it is on sys.path: its modules and its regular
    packages. A folder without `__init__.py` is only a PEP 420 namespace portion, which the import system uses
    when no regular package or module of that name exists on any path entry, so it can never shadow one."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return {n for n in names if n.isidentifier()}


def collisions(exposed: set[str], installed: dict[str, list[str]]) -> list[str]:
    """Exposed names that some installed distribution other than megalite itself also provides."""
    return sorted(f"{name} (also {', '.join(dists)})" for name in exposed
                  if (dists := [d for d in installed.get(name, []) if d.lower() != "megalite"]))


def test_no_exposed_name_collides_with_an_installed_distribution() -> None:
    installed = importlib.metadata.packages_distributions()
    found = {str(root.relative_to(REPO)) or ".": collisions(exposed_names(root), installed) for root in PATH_ROOTS}
    assert all(not c for c in found.values()), found


def test_the_collision_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "tools").mkdir()  # a namespace portion: not exposed
    (tmp_path / "yaml.py").write_text("")
    installed = {"kernels": ["kernels"], "yaml": ["PyYAML"], "tools": ["sloppy"], "megalite": ["megalite"]}
    assert collisions(exposed_names(tmp_path), installed) == ["kernels (also kernels)", "yaml (also PyYAML)"]


def test_transformers_imports_from_the_checkout_root() -> None:
    """The newcomer's case, as a separate interpreter whose sys.path[0] is the checkout root."""
    code = ("import kernels, transformers; from transformers import LlamaForCausalLM; "
            "from transformers.models.llama import modeling_llama; import megalite.kernels as mk; "
            "print(kernels.__file__); print(mk.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    pypi_kernels, ours = out.stdout.split()
    assert not Path(pypi_kernels).resolve().is_relative_to(REPO / "kernels"), pypi_kernels
    assert Path(ours).resolve() == REPO / "kernels" / "_package.py"


def test_hf_round_trip_with_pypi_kernels_installed(tmp_path: Path) -> None:
    """PyPI's `kernels` must be present (the test extra asks for it), or this would not test the case."""
    importlib.metadata.distribution("kernels")
    import kernels  # resolved beside the checkout root (pytest put it on sys.path): PyPI's, not the folder
    assert Path(kernels.__file__).resolve().parent != REPO / "kernels", kernels.__file__
    from transformers import LlamaForCausalLM

    vocab = 67
    cfg = tiny_model_cfg("llama", vocab_size=vocab, seq_len=16)
    model = GPT(cfg, ParallelState(), seed=3).eval()
    ckpt = save_sharded(tmp_path / "ckpt", 1, model, None, {}, ParallelState(), keep=0)
    assert export_main(["--input", str(ckpt), "--output", str(tmp_path / "hf"), "--quiet"]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, vocab, (1, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (model(ids)[..., :vocab] - hf(ids).logits).abs().max().item()
    assert err <= 1e-5, err  # the same fp32 weights, different op order: a few ulps (tests/test_hf.py says why)
