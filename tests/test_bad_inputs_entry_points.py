"""One validator for every entry point (megalite.config.validate.model_problems): a checkpoint's index.json edited to
a model pretrain.py would refuse is refused by generate, export_hf, convert_checkpoint and train.init_from alike
(exit 4, one line naming the field, nothing written), and the estimator and the planner refuse the dims pretrain.py
refuses (exit 2). A checkpoint with a multi-token prediction module converts with it and exports naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from megalite.checkpoint.sharded import find, read_index
from megalite.training.trainer import main as pretrain_main
from tests.conftest import SMALL_RUN
from tests.test_bad_inputs import CKPT, CONFIG, assert_one_line, snapshot
from tools import convert_checkpoint, estimate, export_hf, generate, plan

MLA = ["--model.num_kv_heads", "4", "--model.norm_eps", "1e-6", "--mla.kv_lora_rank", "16", "--mla.qk_rope_head_dim", "8",
       "--mla.qk_nope_head_dim", "8", "--mla.v_head_dim", "8"]


@pytest.fixture(scope="module")
def ckpt(demo_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MLA model with one MTP module, one step trained."""
    root = tmp_path_factory.mktemp("entry")
    assert pretrain_main([*SMALL_RUN, *MLA, "--mtp.num_layers", "1", "--data.cache_dir", demo_cache_dir,
                          "--train.steps", "1", "--checkpoint.dir", str(root / "ck"),
                          "--logging.dir", str(root / "log")]) == 0
    step = find(str(root / "ck"), "")
    assert step is not None
    return step


def _edited(ckpt: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    out = tmp_path / "edited" / ckpt.name
    shutil.copytree(ckpt, out)
    index = json.loads((out / "index.json").read_text())
    edit(index["model"])
    (out / "index.json").write_text(json.dumps(index))
    return out


EDITS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown rope kind", lambda m: m.update(rope_scaling="yarnn"), "rope_scaling='yarnn'"),
    ("rope factor below 1", lambda m: m.update(rope_scaling="yarn", rope_factor=0.5, rope_original_max_positions=16),
     "rope_factor = 0.5"),
    ("rope factor of the wrong type", lambda m: m.update(rope_factor="two"), "rope_factor"),
    ("odd MLA rope width", lambda m: m["mla"].update(qk_rope_head_dim=7), "qk_rope_head_dim = 7 must be even"),
    ("MLA widths a list", lambda m: m.update(mla=[16, 8]), "mla=[16, 8]"),
    ("MTP on gpt2", lambda m: m.update(arch="gpt2"), "arch=llama"),
    ("MTP depth of the wrong type", lambda m: m.update(mtp_layers="1"), "mtp_layers='1'"),
    ("more MTP layers than positions", lambda m: m.update(mtp_layers=40), "must be below model.seq_len"),
]


@pytest.mark.parametrize("what, edit, needle", EDITS, ids=[e[0] for e in EDITS])
def test_every_tool_refuses_an_index_pretrain_would_refuse(ckpt: Path, tmp_path: Path, demo_cache_dir: str,
                                                           capsys: pytest.CaptureFixture[str], what: str,
                                                           edit: Callable[[dict[str, Any]], None], needle: str) -> None:
    bad = _edited(ckpt, tmp_path, edit)
    before = snapshot(tmp_path)
    runs: list[tuple[Callable[[list[str]], int], list[str]]] = [
        (generate.main, ["--checkpoint", str(bad), "--prompt", "def", "--max-tokens", "2"]),
        (export_hf.main, ["--input", str(bad), "--output", str(tmp_path / "hf"), "--quiet"]),
        (convert_checkpoint.main, ["--from", "megalite", "--to", "dcp", "--input", str(bad), "--output",
                                   str(tmp_path / "dcp"), "--quiet"]),
        (pretrain_main, [*SMALL_RUN, "--data.cache_dir", demo_cache_dir, "--train.steps", "1",
                         "--train.init_from", str(bad), "--logging.dir", str(tmp_path / "log")]),
    ]
    for tool, argv in runs:
        capsys.readouterr()
        got = tool(argv)
        assert_one_line(capsys.readouterr().err, got, CKPT, needle)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flags, needle", [
    (["--preset", "llama-160m", "--kv-lora-rank", "-1"], "kv_lora_rank': -1"),
    (["--preset", "llama-160m", "--kv-lora-rank", "64", "--qk-rope-head-dim", "7"], "qk_rope_head_dim = 7 must be even"),
    (["--preset", "gpt2-small", "--mtp-layers", "1"], "needs model.arch=llama"),
    (["--preset", "llama-160m", "--mtp-layers", "4096"], "must be below model.seq_len"),
])
def test_estimate_and_plan_refuse_what_pretrain_refuses(flags: list[str], needle: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    for tool, argv in ((estimate.main, flags), (plan.main, [*flags, "--global-batch-size", "64"])):
        capsys.readouterr()
        got = tool(argv)
        assert_one_line(capsys.readouterr().err, got, CONFIG, needle)


def test_estimate_checks_a_pretrain_configs_model_too(capsys: pytest.CaptureFixture[str]) -> None:
    """Config flags to the estimator (`--model.*`) meet the same rules, RoPE scaling included (not in its dims)."""
    for flags, needle in ((["--model.rope_scaling", "yarnn"], "rope_scaling='yarnn'"),
                          (["--model.arch", "gpt2", "--mtp.num_layers", "1"], "needs model.arch=llama")):
        capsys.readouterr()
        got = estimate.main(flags)
        assert_one_line(capsys.readouterr().err, got, CONFIG, needle)


def test_mtp_is_carried_by_convert_and_named_by_export(ckpt: Path, tmp_path: Path, demo_cache_dir: str,
                                                      capsys) -> None:
    """convert_checkpoint keeps the MTP module through DCP and a new layout; export_hf writes MLA + MTP as
    DeepseekV3's hub layout (tests/test_hf_deepseek.py holds that against transformers) and names an MTP module it
    has no place for (a model without MLA exports as LlamaForCausalLM)."""
    dcp, back = tmp_path / "dcp", tmp_path / "back"
    assert convert_checkpoint.main(["--from", "megalite", "--to", "dcp", "--input", str(ckpt), "--output", str(dcp),
                                    "--quiet"]) == 0
    assert convert_checkpoint.main(["--from", "dcp", "--to", "megalite", "--input", str(dcp), "--output", str(back),
                                    "--tp", "2", "--quiet"]) == 0
    back_step = find(str(back), "")
    assert back_step is not None and read_index(back_step)["model"]["mtp_layers"] == 1
    mtp = {k for k in read_index(ckpt)["tensors"] if k.startswith("param/mtp.")}
    assert mtp and mtp <= set(read_index(back_step)["tensors"])
    capsys.readouterr()
    assert export_hf.main(["--input", str(ckpt), "--output", str(tmp_path / "hf"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "not exported" not in err, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert pretrain_main([*SMALL_RUN, "--mtp.num_layers", "1", "--data.cache_dir", demo_cache_dir, "--train.steps",
                          "1", "--checkpoint.dir", str(tmp_path / "plain"), "--logging.dir", str(tmp_path / "log")]) == 0
    capsys.readouterr()
    assert export_hf.main(["--input", str(tmp_path / "plain"), "--output", str(tmp_path / "hf2"), "--quiet"]) == 0
    assert "not exported (LlamaForCausalLM has no place for them): mtp.layers.0 (" in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--mla.v_head_dim", "64"], "mla.v_head_dim set but MLA is off"),
    (["--model.rope_factor", "4", "--model.rope_original_max_positions", "16"],
     "model.rope_factor, model.rope_original_max_positions set but model.rope_scaling = none"),
    (["--mtp.loss_weight", "0.5"], "mtp.loss_weight set but multi-token prediction is off"),
])
def test_a_flag_for_a_feature_that_is_off_is_refused(flags: list[str], needle: str, demo_cache_dir: str,
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Never ignored: a run that dropped the flag would train other than the user meant (exit 2, before anything)."""
    got = pretrain_main([*SMALL_RUN, *flags, "--data.cache_dir", demo_cache_dir, "--train.steps", "1",
                         "--logging.dir", str(tmp_path / "log")])
    assert_one_line(capsys.readouterr().err, got, CONFIG, needle)
    assert not (tmp_path / "log").exists()
