"""A MoE checkpoint's index.json with bad routing fields ("moe_" + each `[moe]` field): every reader (generate,
`--checkpoint.load`, export_hf, reshard) refuses it with one line and the checkpoint exit code, by the SAME rules as the
`[moe]` config section (megalite/checkpoint/index_check.py `moe_info_problems`).

Before, `moe_top_k 0` or `moe_capacity_factor -1` generated with no expert contributing (exit 0), and
`moe_top_k 99`, an unknown router, `moe_every 0` or `moe_experts "8"` ended in tracebacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megalite.training.trainer import main
from tests.conftest import SMALL_RUN
from tests.test_bad_inputs import CKPT, assert_one_line, snapshot
from tests.test_bad_inputs_checkpoint import _copy, _edit_index
from tools.export_hf import main as export_main
from tools.generate import main as generate_main
from tools.reshard_checkpoint import main as reshard_main

MOE_RUN = [*SMALL_RUN, "--moe.experts", "4", "--moe.top_k", "2", "--train.steps", "1"]

# (field, bad value, what the one line must name)
BAD = [("moe_top_k", 0, "moe.top_k 0"), ("moe_top_k", 99, "moe.top_k 99"), ("moe_top_k", "2", "moe_top_k"),
       ("moe_top_k", True, "moe_top_k"), ("moe_capacity_factor", -1, "moe.capacity_factor"),
       ("moe_capacity_factor", 1e308, "moe.capacity_factor"), ("moe_router", "switch", "moe.router"),
       ("moe_router", 3, "moe_router"), ("moe_every", 0, "moe.every"), ("moe_experts", "8", "moe_experts"),
       ("moe_experts", -4, "moe.experts"), ("moe_experts", 10**12, "moe.experts"), ("moe_experts", 4.0, "moe_experts"),
       ("moe_ffn_hidden_size", 10**9, "moe.ffn_hidden_size"), ("moe_shared_experts", 10**9, "moe.shared_experts"),
       ("moe_first_dense", 2, "moe.first_dense"), ("moe_groups", 2, "moe.groups"), ("moe_renorm", "yes", "moe_renorm"),
       ("moe_route_scale", 1e308, "moe.route_scale"), ("moe_aux_loss", -1.0, "moe.aux_loss")]


@pytest.fixture(scope="module")
def moe_ck(demo_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny 1-step MoE checkpoint for the whole module (each case edits a copy)."""
    root = tmp_path_factory.mktemp("moeidx")
    args = ["--data.cache_dir", demo_cache_dir, *MOE_RUN]
    assert main([*args, "--logging.dir", str(root / "log"), "--checkpoint.dir", str(root / "good")]) == 0
    return {"root": root, "args": args, "good": root / "good"}


def _bad_copy(moe_ck: dict[str, Any], tmp_path: Path, key: str, value: Any) -> Path:
    ckpt = _copy(moe_ck["good"], tmp_path / "ck")
    _edit_index(ckpt / "step_00000001", lambda index: index["model"].__setitem__(key, value))
    return ckpt


@pytest.mark.parametrize("key,value,needle", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_every_reader_refuses_a_bad_moe_field(moe_ck: dict[str, Any], tmp_path: Path, capsys, key: str, value: Any,
                                              needle: str) -> None:
    ckpt = _bad_copy(moe_ck, tmp_path, key, value)
    before = snapshot(ckpt)
    capsys.readouterr()
    got = generate_main(["--checkpoint", str(ckpt), "--prompt", "the", "--device", "cpu", "--max-tokens", "2"])
    assert_one_line(capsys.readouterr().err, got, CKPT, needle)
    got = export_main(["--input", str(ckpt), "--output", str(tmp_path / "hf"), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, needle)
    assert not (tmp_path / "hf").exists()
    got = reshard_main(["--input", str(ckpt), "--output", str(tmp_path / "re"), "--tp", "1", "--pp", "1"])
    assert_one_line(capsys.readouterr().err, got, CKPT, needle)
    assert not (tmp_path / "re").exists()
    got = main([*moe_ck["args"], "--logging.dir", str(tmp_path / "log"), "--checkpoint.load", str(ckpt),
                "--train.steps", "2"])
    assert_one_line(capsys.readouterr().err, got, CKPT, needle)
    assert snapshot(ckpt) == before


def test_the_unedited_moe_checkpoint_reads(moe_ck: dict[str, Any], capsys) -> None:
    """The control: the same readers accept the checkpoint as written (so the refusals above are the edits')."""
    got = generate_main(["--checkpoint", str(moe_ck["good"]), "--prompt", "the", "--device", "cpu", "--max-tokens", "2"])
    assert got == 0, capsys.readouterr().err
