"""Crafted checkpoint metadata in the converters' readers: a DCP `.metadata` whose fields have other types than
torch writes (megalite/checkpoint/interop/dcp_metadata.py checks each once, after unpickling) and a Megatron-LM
`mp_rank_XX` that is a file are one line with exit 4, never a traceback, and nothing is written."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from megalite.training.trainer import main as pretrain_main
from tests.conftest import SMALL_RUN
from tests.test_bad_inputs import CKPT, assert_one_line, snapshot
from tools import convert_checkpoint


@pytest.fixture(scope="module")
def dcp_dir(demo_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcpmeta")
    assert pretrain_main([*SMALL_RUN, "--data.cache_dir", demo_cache_dir, "--train.steps", "1",
                          "--checkpoint.dir", str(root / "ck"), "--logging.dir", str(root / "log")]) == 0
    assert convert_checkpoint.main(["--from", "megalite", "--to", "dcp", "--input", str(root / "ck"), "--output",
                                    str(root / "dcp"), "--quiet"]) == 0
    return root / "dcp"


def _first(d: dict) -> Any:
    return next(iter(d.values()))


def _tensor(md: Any) -> Any:
    return next(v for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))


CRAFTED: list[tuple[str, Callable[[Any], None], str]] = [
    ("storage_data a list", lambda md: setattr(md, "storage_data", list(md.storage_data.values())),
     "storage_data is list"),
    ("storage_data None", lambda md: setattr(md, "storage_data", None), "storage_data is NoneType"),
    ("state_dict_metadata None", lambda md: setattr(md, "state_dict_metadata", None), "state_dict_metadata is NoneType"),
    ("state_dict_metadata a list", lambda md: setattr(md, "state_dict_metadata", []), "state_dict_metadata is list"),
    ("an entry of another type", lambda md: md.state_dict_metadata.update(x=3), "is a int, not a tensor or bytes"),
    ("a size as text", lambda md: setattr(_tensor(md), "size", "64"), ".size is '64'"),
    ("chunks a dict", lambda md: setattr(_tensor(md), "chunks", {}), ".chunks is a dict"),
    ("a chunk outside its tensor", lambda md: setattr(_tensor(md).chunks[0], "offsets", (10**6,) * len(_tensor(md).size)),
     "not inside its size"),
    ("a storage record of another type", lambda md: md.storage_data.update({next(iter(md.storage_data)): "file"}),
     "not a file name with an offset"),
    ("a negative storage offset", lambda md: setattr(_first(md.storage_data), "offset", -1),
     "not a file name with an offset"),
    ("planner_data a number", lambda md: setattr(md, "planner_data", 5), "planner_data is int"),
]


@pytest.mark.parametrize("what, craft, needle", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_dcp_metadata_is_one_line(dcp_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          what: str, craft: Callable[[Any], None], needle: str) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(dcp_dir, bad)
    (bad / "megalite.sha256.json").unlink()  # a crafted directory carries no checksums of ours
    with open(bad / ".metadata", "rb") as f:
        md = pickle.load(f)  # written by this test's own conversion: trusted
    craft(md)
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    before = snapshot(tmp_path)
    # Every DCP reader (megalite's, torchtitan's, megatron-core's torch_dist) opens .metadata through one function
    # (dcp.read_metadata): the first two cases run all three, the rest the megalite one (suite time).
    readers = ("dcp", "torchtitan", "megatron") if what in (CRAFTED[0][0], CRAFTED[2][0]) else ("dcp",)
    for reader in readers:
        capsys.readouterr()
        got = convert_checkpoint.main(["--from", reader, "--to", "megalite", "--input", str(bad), "--output",
                                       str(tmp_path / "out"), "--quiet"])
        # megatron's torch_dist reader asks for common.pt first: a one-line refusal, whichever thing it names
        assert_one_line(capsys.readouterr().err, got, CKPT, needle if reader != "megatron" else "")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["mp_rank_00", "mp_rank_01_002"])
def test_a_megatron_rank_file_instead_of_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     name: str) -> None:
    it = tmp_path / "iter_0000001"
    it.mkdir()
    (it / name).write_text("not a directory")
    before = snapshot(tmp_path)
    got = convert_checkpoint.main(["--from", "megatron", "--to", "megalite", "--input", str(it), "--output",
                                   str(tmp_path / "out"), "--quiet"])
    assert_one_line(capsys.readouterr().err, got, CKPT, f"{name} is not a directory")
    assert snapshot(tmp_path) == before
