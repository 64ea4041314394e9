"""`--train.init_from` for continued pretraining (docs/checkpoints.md, "Starting from other weights"): a longer
context with the RoPE scaling the run gives, a multi-token prediction module the checkpoint lacks initialised and
named, every weight of the checkpoint carried exactly; and the flags that cannot apply refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.checkpoint.sharded import read_index
from megalite.inference.load import load_model
from megalite.training.trainer import main as pretrain_main
from tests.conftest import SMALL_RUN
from tests.test_bad_inputs import CKPT, assert_one_line, snapshot

# A step at this learning rate (below fp32's resolution of any weight) leaves every loaded weight as it was.
FROZEN = ["--train.lr", "1e-30", "--train.min_lr", "1e-30"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(path)
    return {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}


@pytest.fixture(scope="module")
def base(demo_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("initfrom")
    assert pretrain_main([*SMALL_RUN, "--data.cache_dir", demo_cache_dir, "--train.steps", "1",
                          "--checkpoint.dir", str(root / "base"), "--logging.dir", str(root / "log")]) == 0
    return root / "base"


def test_a_longer_context_with_yarn_and_a_new_mtp_module(base: Path, demo_cache_dir: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert pretrain_main([*SMALL_RUN, "--data.cache_dir", demo_cache_dir, "--train.steps", "1", *FROZEN,
                          "--train.init_from", str(base), "--model.seq_len", "64", "--model.rope_scaling", "yarn",
                          "--model.rope_factor", "2", "--model.rope_original_max_positions", "32",
                          "--mtp.num_layers", "1", "--checkpoint.dir", str(tmp_path / "long"),
                          "--logging.dir", str(tmp_path / "log")]) == 0
    err = capsys.readouterr().out
    assert "new, initialised as a fresh run's: mtp.layers.0" in err, err
    saved = read_index(next((tmp_path / "long").glob("step_*")))["model"]
    assert (saved["seq_len"], saved["rope_scaling"], saved["mtp_layers"]) == (64, "yarn", 1)
    theirs, ours = _weights(base), _weights(tmp_path / "long")
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    # Back from the MTP checkpoint without MTP: its module is named as left out.
    capsys.readouterr()
    assert pretrain_main([*SMALL_RUN, "--data.cache_dir", demo_cache_dir, "--train.steps", "1", *FROZEN,
                          "--train.init_from", str(tmp_path / "long"), "--logging.dir", str(tmp_path / "log2")]) == 0
    assert "not taken (this run has no such module): mtp.layers.0" in capsys.readouterr().out


def test_flags_that_contradict_the_checkpoint_are_refused(demo_cache_dir: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    mla = ["--model.num_kv_heads", "4", "--mla.kv_lora_rank", "16", "--mla.qk_rope_head_dim", "8", "--mla.qk_nope_head_dim", "8",
           "--mla.v_head_dim", "8"]
    run = [*SMALL_RUN, "--data.cache_dir", demo_cache_dir, "--train.steps", "1"]
    for name, extra in (("mla", mla), ("gpt2", ["--model.arch", "gpt2"])):
        assert pretrain_main([*run, *extra, "--checkpoint.dir", str(tmp_path / name),
                              "--logging.dir", str(tmp_path / f"log-{name}")]) == 0
    before = snapshot(tmp_path)
    cases = [(["--train.init_from", str(tmp_path / "mla"), "--mla.v_head_dim", "16"],
              "mla.v_head_dim=16 but the checkpoint has 8"),
             (["--train.init_from", str(tmp_path / "gpt2"), "--mla.kv_lora_rank", "16"],
              "mla.kv_lora_rank=16 but the checkpoint has no MLA"),
             (["--train.init_from", str(tmp_path / "gpt2"), "--model.seq_len", "64"],
              "learned position embeddings"),
             (["--checkpoint.load", str(tmp_path / "mla"), "--mla.qk_nope_head_dim", "16"],
              "mla.qk_nope_head_dim=16 but the checkpoint has 8")]
    for extra, needle in cases:
        capsys.readouterr()
        got = pretrain_main([*run, *extra, "--logging.dir", str(tmp_path / "refused")])
        assert_one_line(capsys.readouterr().err, got, CKPT, needle)
    assert snapshot(tmp_path) == before


def test_init_from_takes_a_deepseek_v3_directory_as_import_hf_does(tmp_path: Path) -> None:
    """The HF directories train.init_from takes are tools/import_hf.py's (the same mapping): a DeepseekV3 (MLA, MoE,
    the hub's MTP layer) imports into the cache with the tensors import_hf writes."""
    pytest.importorskip("transformers")
    from megalite.training.init_from import resolve_init_from
    from tests.test_hf_deepseek import _checkpoint_tensors, hf_model
    from tools.import_hf import main as import_main

    hf_model().save_pretrained(tmp_path / "hf")
    got = resolve_init_from(str(tmp_path / "hf"), str(tmp_path / "cache"))
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "imported"), "--quiet"]) == 0
    assert read_index(got)["model"] == read_index(tmp_path / "imported")["model"]
    assert "mla" in read_index(got)["model"]
    theirs, ours = _checkpoint_tensors(tmp_path / "imported"), _checkpoint_tensors(got)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
