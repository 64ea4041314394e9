"""Megatron-LM checkpoints in (tools/convert_checkpoint.py --from megatron), checked against megatron-core itself.

tests/megatron_writer.py builds a tiny Llama-style GPTModel with megatron-core (GQA, SwiGLU, RoPE, untied head),
runs its forward on fixed tokens and saves it as `torch_dist` with megatron-core's `dist_checkpointing.save`, and as
legacy TP 2 x PP 2 files. The converted megalite model's logits equal megatron-core's (fp32, same function,
different kernels: atol 1e-5 on logits of size ~1; a misplaced query group or a swapped gate/up half moves them
by > 1e-2), at the converted layouts tp1 and tp2 x pp2 (the latter loaded into one process, and its tensors
bit-equal to tp1's). Bad inputs are one line and exit code 4, with nothing written.
megatron-core installs from the registry without changing torch (its torch_dist writer also needs psutil);
where it is absent the module is skipped, saying so."""

from __future__ import annotations

import argparse
import fractions
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core psutil)")
pytest.importorskip("psutil", reason="megatron-core's torch_dist writer needs psutil (pip install psutil)")

from megalite.inference.load import load_model  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.test_interop_dcp import _all  # noqa: E402
from tests.test_reliability import REPO, _env  # noqa: E402
from tools.convert_checkpoint import main as convert  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_writer.py"), str(out), str(free_port())],
                          capture_output=True, text=True, env=_env(), cwd=str(REPO), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    model, _ = load_model(ckpt)
    with torch.no_grad():
        return model(ids)


def _convert(src: Path, out: Path, *layout: str) -> int:
    return convert(["--from", "megatron", "--to", "megalite", "--input", str(src), "--output", str(out), "--quiet",
                    *layout])


@pytest.mark.timeout(900)  # the module's first test also pays the megatron-core writer run (~2 min on 2 busy cores)
@pytest.mark.parametrize("kind", ["torch_dist", "legacy"])
def test_converted_logits_equal_megatron_core_at_tp1_and_tp2_pp2(written: Path, tmp_path: Path, kind: str) -> None:
    ref = torch.load(written / "logits.pt", weights_only=True)
    assert _convert(written / kind, tmp_path / "tp1") == 0
    assert _convert(written / kind, tmp_path / "tp2pp2", "--tp", "2", "--pp", "2") == 0
    for out in ("tp1", "tp2pp2"):
        torch.testing.assert_close(_logits(tmp_path / out, ref["ids"]), ref["logits"], rtol=0, atol=1e-5)
    a, b = _all(tmp_path / "tp1"), _all(tmp_path / "tp2pp2")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _copy(written: Path, tmp_path: Path) -> Path:
    src = tmp_path / "in"
    shutil.copytree(written / "torch_dist", src)
    return src / "iter_0000005"


def _common(it: Path, **changes: object) -> None:
    common = torch.load(it / "common.pt", weights_only=False)
    args = vars(common["args"])
    args.update(changes)
    common["args"] = argparse.Namespace(**args)
    torch.save(common, it / "common.pt")


@pytest.mark.timeout(900)
def test_bad_megatron_inputs_are_one_line_exit_4(written: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def refused(src: Path, text: str) -> None:
        before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
        assert _convert(src.parent, tmp_path / "out") == 4
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out").exists() and {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before

    it = _copy(written, tmp_path)
    _common(it, num_experts=8)
    refused(it, "mixture-of-experts layers (num_experts=8)")
    _common(it, num_experts=None, multi_latent_attention=True)
    refused(it, "multi-latent attention (MLA)")
    _common(it, multi_latent_attention=False)
    meta = json.loads((it / "metadata.json").read_text())
    (it / "metadata.json").write_text(json.dumps(dict(meta, num_layers=8)))
    refused(it, "metadata.json and common.pt disagree (num_layers: metadata.json 8 vs common.pt args 4)")
    (it / "metadata.json").write_text(json.dumps(meta))
    _common(it, tokenizer_model=fractions.Fraction(1, 3))  # a class outside the allow-list
    refused(it, "needs the class fractions.Fraction")
    _common(it, tokenizer_model=None)
    shard = sorted(it.glob("*.distcp"))[-1]
    shard.unlink()
    refused(it, f"shard file {shard.name} named in .metadata is missing")
