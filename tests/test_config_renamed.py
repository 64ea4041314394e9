"""Fields that moved into their feature's section (`megalite/config/aliases.py`) keep working under their old
names: on the command line and in a --config file with one stderr note per name, and silently in what megalite
wrote before the move (a run's config.toml, a checkpoint's index.json and saved run config)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import tomli_w

from megalite.checkpoint.model_shape import apply_checkpoint_shape
from megalite.checkpoint.sharded import save_sharded
from megalite.config import Config, load_config, parse_args
from megalite.config.aliases import RENAMED, saved_config
from megalite.errors import CheckpointError, ConfigError
from megalite.inference.load import load_model
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from megalite.training.checkpointing import check_same_optimizer
from tests.moe_utils import tiny_moe_cfg

# A config.toml as megalite wrote it before the feature sections: every renamed field under its old name.
OLD_CONFIG = {
    "model": {"preset": "tiny", "moe_experts": 4, "moe_top_k": 1, "moe_router": "deepseek", "moe_renorm": False,
              "moe_capacity_factor": 1.5},
    "train": {"fp8": "rowwise", "fp8_min_dim": 64, "optimizer": "muon", "weight_decay": 0.05, "beta1": 0.8,
              "beta2": 0.9, "adam_eps": 1e-6, "muon_momentum": 0.9, "muon_nesterov": False, "muon_ns_steps": 3,
              "muon_rms": 0.3, "lr": 1e-3},
}


def _check_new_places(cfg: Config) -> None:
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.router, cfg.moe.renorm, cfg.moe.capacity_factor) == \
        (4, 1, "deepseek", False, 1.5)
    assert (cfg.fp8.recipe, cfg.fp8.min_dim) == ("rowwise", 64)
    opt, muon = cfg.optimizer, cfg.muon
    assert (opt.name, opt.weight_decay, opt.beta1, opt.beta2, opt.adam_eps) == ("muon", 0.05, 0.8, 0.9, 1e-6)
    assert (muon.momentum, muon.nesterov, muon.ns_steps, muon.rms) == (0.9, False, 3, 0.3)
    assert cfg.train.lr == 1e-3  # a field that did not move is where it was


def test_the_table_maps_old_names_that_are_gone_to_fields_that_exist() -> None:
    fields = {f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
              for f in dataclasses.fields(getattr(Config(), s.name))}
    assert set(RENAMED.values()) <= fields and not set(RENAMED) & fields
    assert len(set(RENAMED.values())) == len(RENAMED) == 17 + 2 + 5 + 4  # moe (seq_aux_loss too), fp8, optimizer, muon


def test_old_flags_work_with_one_note_each(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    argv = [f"--{section}.{name}={value}" for section, table in OLD_CONFIG.items() for name, value in table.items()]
    cfg = parse_args(argv + ["--model.moe_top_k", "1", "--train.muon_nesterov=false"])  # two names given twice
    _check_new_places(cfg)
    notes = capsys.readouterr().err.splitlines()
    old = [f"{s}.{n}" for s, table in OLD_CONFIG.items() for n in table if f"{s}.{n}" in RENAMED]
    assert len(old) == 16 and [n.split()[3] for n in notes] == old  # one note per old name, in order
    assert notes[0] == ("note: config key model.moe_experts is now moe.experts (--moe.experts, or experts under "
                        "[moe]); the old name still works")
    monkeypatch.setenv("RANK", "1")  # the other ranks parse the same argv silently
    assert parse_args(["--model.moe_experts", "2"]).moe.experts == 2 and capsys.readouterr().err == ""
    monkeypatch.delenv("RANK")
    assert parse_args(["--train.muon_nesterov"]).muon.nesterov is True  # an old bool is a bare flag too


def test_old_keys_in_a_config_file_work_with_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "old.toml"
    path.write_text(tomli_w.dumps(OLD_CONFIG))
    _check_new_places(parse_args(["--config", str(path)]))
    assert "note: config key train.optimizer is now optimizer.name" in capsys.readouterr().err
    # The old and the new name agreeing in one file is one value; the CLI wins over the file.
    path.write_text(tomli_w.dumps({"train": {"fp8": "rowwise"}, "fp8": {"recipe": "rowwise"}}))
    assert parse_args(["--config", str(path)]).fp8.recipe == "rowwise"
    assert parse_args(["--config", str(path), "--train.fp8", "none"]).fp8.recipe == "none"


@pytest.mark.parametrize("old, new", [("train.optimizer", "optimizer.name"), ("train.fp8", "fp8.recipe"),
                                      ("model.moe_top_k", "moe.top_k"), ("train.muon_ns_steps", "muon.ns_steps")])
def test_an_old_and_a_new_name_that_disagree_are_refused(tmp_path: Path, old: str, new: str) -> None:
    """Neither name is silently taken over the other: in one file, on the command line, and in a saved config."""
    values = {"train.optimizer": ("muon", "adamw"), "train.fp8": ("rowwise", "tensorwise"),
              "model.moe_top_k": (2, 1), "train.muon_ns_steps": (5, 3)}[old]
    (os_, of), (ns, nf) = old.split("."), new.split(".")
    table: dict = {os_: {of: values[0]}}
    table.setdefault(ns, {})[nf] = values[1]
    path = tmp_path / "both.toml"
    path.write_text(tomli_w.dumps(table))
    for run in (lambda: parse_args(["--config", str(path)]), lambda: load_config(path),
                lambda: parse_args([f"--{old}", str(values[0]), f"--{new}", str(values[1])])):
        with pytest.raises(ConfigError, match=f"{old}.*{new}|{new}.*{old}"):
            run()


def test_a_saved_config_of_before_loads_silently(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(OLD_CONFIG))
    _check_new_places(load_config(path))
    assert capsys.readouterr().err == ""


def test_a_saved_run_config_of_before_reads_in_the_new_sections() -> None:
    """What the exporters (DCP, torchtitan) and the optimizer check read of a checkpoint's saved run config."""
    new = saved_config({"config": OLD_CONFIG})
    assert new["optimizer"] == {"name": "muon", "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.9, "adam_eps": 1e-6}
    assert new["train"] == {"lr": 1e-3} and new["moe"]["router"] == "deepseek" and new["fp8"]["min_dim"] == 64
    assert saved_config({}) == {} and saved_config({"config": "junk"}) == {}


def test_a_checkpoint_of_before_loads(tmp_path: Path) -> None:
    """index.json's model info records a MoE model's fields as moe_*, and its saved run config (extra.config)
    has the old names: the model, its shape for pretrain.py and the optimizer check all read them."""
    root = tmp_path / "ckpt"
    model_cfg = tiny_moe_cfg(moe_router="deepseek", moe_top_k=1, moe_first_dense=1, num_layers=2)
    path = save_sharded(root, 1, GPT(model_cfg, ParallelState(), seed=1), None, {"config": OLD_CONFIG},
                        ParallelState(), keep=1)
    index = json.loads((path / "index.json").read_text())
    assert index["model"]["moe_router"] == "deepseek" and index["extra"]["config"]["train"]["optimizer"] == "muon"
    model, _ = load_model(path)
    assert model.cfg.moe.router == "deepseek" and type(model.layers["1"].mlp).__name__ == "MoELayer"
    cfg = Config()
    cfg.checkpoint.load = str(path)
    cfg = apply_checkpoint_shape(cfg, [])
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.router, cfg.moe.first_dense) == (4, 1, "deepseek", 1)
    cfg = Config()
    cfg.checkpoint.load, cfg.moe.router = str(path), "qwen3"
    with pytest.raises(CheckpointError, match="moe.router='qwen3' but the checkpoint has 'deepseek'"):
        apply_checkpoint_shape(cfg, ["--model.moe_router", "qwen3"])  # the old flag counts as given
    check_same_optimizer(index, "muon", path)  # the saved train.optimizer read as optimizer.name
    with pytest.raises(CheckpointError, match="trained with optimizer.name=muon"):
        check_same_optimizer(index, "adamw", path)


def test_the_config_and_its_feature_sections_import_without_torch() -> None:
    """The sections live with their features (moe, optim, layers), whose other modules need torch: importing the
    config must not pull it in (`megalite/optim/__init__.py` exports its torch parts lazily for that)."""
    import subprocess
    import sys

    code = ("import sys, megalite.config, megalite.moe.config, megalite.optim.config, megalite.fp8.config; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_dashes_in_a_config_file_mean_underscores(tmp_path: Path) -> None:
    """`tune-malloc` in a TOML file is `tune_malloc`, as `--train.tune-malloc` is on the command line; the two
    spellings set to different values are refused, like an old and a new name."""
    path = tmp_path / "dashed.toml"
    path.write_text('[train]\ntune-malloc = false\nmicro-batch-size = 3\n')
    cfg = parse_args(["--config", str(path)])
    assert (cfg.train.tune_malloc, cfg.train.micro_batch_size) == (False, 3)
    path.write_text('[train]\ntune-malloc = false\ntune_malloc = true\n')
    with pytest.raises(ConfigError, match="train.tune-malloc = False and train.tune_malloc = True"):
        parse_args(["--config", str(path)])
