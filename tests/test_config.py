"""Tests for megalite.config: defaults, presets, precedence, TOML/CLI parsing, --help, round trips,
resolve and every validation rule (each asserting the message a user would read).

Everything here is pure Python except the two small torch checks at the end; no numeric
tolerances are needed (all values are compared exactly).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from megalite.config import (
    PRESETS,
    Config,
    config_from_dict,
    config_to_dict,
    load_config,
    micro_batches_per_step,
    parse_args,
    resolve,
    resolved_device,
    resolved_dtype,
    save_config,
    validate,
)
from megalite.errors import ConfigError, MegaliteError


def _cfg(**overrides: Any) -> Config:
    """A parsed config with `section__field=value` overrides (CLI strings or typed values)."""
    argv: list[str] = []
    for key, value in overrides.items():
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        argv.append(f"--{key.replace('__', '.')}={value}")
    return parse_args(argv)


def _write_toml(tmp_path: Path, d: dict[str, Any], name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(tomli_w.dumps(d))
    return str(path)


# ----------------------------------------------------------------------------- defaults and presets


def test_dataclass_defaults() -> None:
    cfg = Config()
    m = cfg.model
    assert (m.preset, m.arch, m.num_kv_heads, m.ffn_hidden_size, m.tie_embeddings) == ("tiny", "llama", 0, 0, None)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.schedule) == (1, 1, 0, "1f1b")
    assert cfg.parallel.pp_layers == [] and cfg.data.path == [] and cfg.data.weights == []
    assert (cfg.train.steps, cfg.train.lr, cfg.train.global_batch_size) == (300, 3e-3, 0)
    assert (cfg.checkpoint.dir, cfg.checkpoint.keep, cfg.logging.dir) == ("", 3, "runs/latest")
    # default_factory: sections and lists are not shared between instances
    assert Config().parallel.pp_layers is not cfg.parallel.pp_layers


def test_every_field_has_a_doc() -> None:
    for section in dataclasses.fields(Config):
        assert section.metadata.get("doc")
        for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            assert f.metadata.get("doc"), f"{section.name}.{f.name} has no doc"


def test_no_args_applies_tiny_preset() -> None:
    cfg = parse_args([])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_heads, cfg.model.num_kv_heads) == (4, 128, 4, 2)


def test_presets_values() -> None:
    assert set(PRESETS) == {"tiny", "gpt2-tiny", "gpt2-small", "gpt2-medium", "llama-160m", "llama-1b", "llama-7b",
                            "tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "tiny-deepseek",  # MoE: docs/moe.md
                            "gpt-oss-20b", "tiny-gpt-oss", "gemma3-1b", "tiny-gemma3",  # docs/attention.md
                            "qwen3.5"}  # docs/linear-attention.md
    m = parse_args(["--model.preset", "llama-1b"]).model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (16, 2048, 32, 8, 8192)
    assert (m.vocab_size, m.rope_theta, m.tie_embeddings, m.seq_len) == (128256, 500000.0, True, 2048)
    m = parse_args(["--model.preset", "gpt2-small"]).model
    assert (m.arch, m.num_layers, m.hidden_size, m.seq_len, m.vocab_size) == ("gpt2", 12, 768, 1024, 50257)
    with pytest.raises(TypeError):  # read-only: no run can silently change a preset for the next
        PRESETS["tiny"]["num_layers"] = 9  # type: ignore[index]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_resolves_and_validates(preset: str) -> None:
    cfg = resolve(parse_args(["--model.preset", preset]), world_size=1)
    validate(cfg, world_size=1)


# ----------------------------------------------------------------------------- precedence, TOML, CLI


def test_precedence_preset_file_cli(tmp_path: Path) -> None:
    path = _write_toml(tmp_path, {"model": {"preset": "gpt2-tiny", "num_layers": 6, "hidden_size": 256},
                                  "train": {"lr": 1, "steps": 7}})
    cfg = parse_args(["--config", path])
    assert cfg.model.arch == "gpt2"                       # from the file's preset
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (6, 256)  # file beats preset
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)   # TOML int widened to float
    cfg = parse_args(["--config", path, "--model.num_layers", "8", "--model.preset", "llama-160m"])
    assert cfg.model.num_layers == 8                      # CLI beats file
    assert cfg.model.hidden_size == 256                   # file beats the CLI-chosen preset
    assert (cfg.model.arch, cfg.model.ffn_hidden_size) == ("llama", 2048)  # preset chosen by the CLI


def test_toml_types(tmp_path: Path) -> None:
    d = {"parallel": {"sp": True, "pp_layers": [1, 3]}, "data": {"path": ["a", "b"], "weights": [1, 0.5]},
         "model": {"tie_embeddings": False}}
    cfg = parse_args(["--config", _write_toml(tmp_path, d)])
    assert cfg.parallel.sp is True and cfg.parallel.pp_layers == [1, 3]
    assert cfg.data.path == ["a", "b"] and cfg.data.weights == [1.0, 0.5]
    assert cfg.model.tie_embeddings is False


@pytest.mark.parametrize("argv, expected", [
    (["--train.steps", "5"], 5),
    (["--train.steps=5"], 5),
    (["--train.steps", "3", "--train.steps", "5"], 5),  # last one wins
    (["--train.steps=-5"], -5),                         # parsed here, rejected by validate
])
def test_cli_int_forms(argv: list[str], expected: int) -> None:
    assert parse_args(argv).train.steps == expected


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("True", True), ("1", True), ("yes", True),
    ("false", False), ("FALSE", False), ("0", False), ("no", False),
])
def test_cli_bools(text: str, expected: bool) -> None:
    assert parse_args(["--parallel.sp", text]).parallel.sp is expected
    assert parse_args([f"--parallel.sp={text}"]).parallel.sp is expected


def test_cli_misc_forms() -> None:
    cfg = parse_args(["--parallel.sp", "--data.path", "a, b", "--data.weights=0.3,0.7", "--train.micro-batch-size", "3",
                      "--parallel.pp_layers=2,2", "--model.tie_embeddings", "none", "--logging.dir=x=y"])
    assert cfg.parallel.sp is True                        # bare bool flag
    assert cfg.data.path == ["a", "b"] and cfg.data.weights == [0.3, 0.7]
    assert cfg.train.micro_batch_size == 3                # dashes accepted for underscores
    assert cfg.parallel.pp_layers == [2, 2] and cfg.model.tie_embeddings is None
    assert cfg.logging.dir == "x=y"                       # only the first '=' splits
    assert parse_args(["--data.path="]).data.path == []
    assert parse_args(["--model.tie_embeddings=yes"]).model.tie_embeddings is True


def test_help_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--model.num_layers", "3", flag])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        flat = " ".join(out.split())  # the docs are wrapped to the terminal
        for section in dataclasses.fields(Config):
            assert f"[{section.name}]" in out
            for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
                assert f"--{section.name}.{f.name} " in out
                assert " ".join(f.metadata["doc"].split()) in flat
        assert "list[int]" in out and "bool | None" in out and "llama-7b" in out


# ----------------------------------------------------------------------------- parse-time errors


@pytest.mark.parametrize("argv, message", [
    (["--model.hiden_size", "3"], "unknown config key 'model.hiden_size' (did you mean 'model.hidden_size'?)"),
    (["--modle.hidden_size", "3"], "unknown config section 'modle' in 'modle.hidden_size' (did you mean 'model'?)"),
    (["--lr", "0.1"], "unknown config key 'lr' (did you mean 'train.lr'?)"),
    (["--model.num_layers", "abc"], "model.num_layers: expected int, got 'abc'"),
    (["--train.lr", "fast"], "train.lr: expected float, got 'fast'"),
    (["--parallel.sp", "maybe"], "parallel.sp: expected bool"),
    (["--parallel.pp_layers", "1,x"], "parallel.pp_layers[1]: expected int, got 'x'"),
    (["--model.preset", "gpt3"], "unknown preset 'gpt3'"),
    (["--model.preset", "gpt2-smal"], "(did you mean 'gpt2-small'?)"),
    (["stray"], "unexpected argument 'stray'"),
    # The docs' old blend spelling: a list is one comma-separated value, and the error says so.
    (["--data.path", "a.jsonl", "data/web"], "'data/web' (after --data.path a.jsonl): options look like --section.field "
                                             "VALUE, and a list is one comma-separated value"),
    (["--train.lr"], "--train.lr needs a value"),
    (["--config", "a.toml", "--config", "b.toml"], "--config given twice"),
])
def test_cli_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_args(argv)
    assert message in str(exc.value)


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(ConfigError, match="tiny, gpt2-tiny, gpt2-small, gpt2-medium, llama-160m, llama-1b, llama-7b"):
        parse_args(["--model.preset", "huge"])


@pytest.mark.parametrize("d, message", [
    ({"model": {"num_layers": "4"}}, "model.num_layers: expected int, got '4'"),
    ({"model": {"num_layers": 4.5}}, "model.num_layers: expected int, got 4.5"),
    ({"parallel": {"sp": 1}}, "parallel.sp: expected bool, got 1"),
    ({"train": {"lr": True}}, "train.lr: expected float, got True"),
    ({"model": {"hidden": 3}}, "unknown config key 'model.hidden' (did you mean 'model.hidden_size'?)"),
    ({"trian": {"lr": 3}}, "unknown config section 'trian' in 'trian.lr' (did you mean 'train'?)"),
    ({"lr": 3}, "unknown config key 'lr' (did you mean 'train.lr'?)"),
    ({"model": 3}, "'model' in the config must be a table"),
    ({"model": {"preset": "nope"}}, "unknown preset 'nope'"),
])
def test_dict_errors(d: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(d)
    assert message in str(exc.value)


def test_parse_errors_reported_together() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_args(["--model.num_layers=x", "--train.lrr=1", "--parallel.tp=two"])
    text = str(exc.value)
    assert "3 problems" in text and len(text.splitlines()) == 4


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        parse_args(["--config", str(tmp_path / "missing.toml")])
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nnum_layers = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_args(["--config", str(bad)])
    assert issubclass(ConfigError, MegaliteError)


# ----------------------------------------------------------------------------- serialization


def test_save_load_round_trip(tmp_path: Path) -> None:
    cfg = parse_args(["--model.preset", "gpt2-tiny", "--parallel.pp_layers=1,3", "--data.path=x,y",
                      "--data.weights=1,2", "--train.lr=0.1", "--parallel.sp=true"])
    path = tmp_path / "deep" / "dir" / "config.toml"
    save_config(cfg, path)                                # creates parent dirs
    assert load_config(path) == cfg                       # tie_embeddings None survives (dropped, re-defaulted)
    assert parse_args(["--config", str(path)]) == cfg
    resolved = resolve(cfg, world_size=2)
    save_config(resolved, path)                           # overwrite in place
    assert load_config(path) == resolved
    assert not list(path.parent.glob("*.tmp"))


def test_config_to_dict_drops_none() -> None:
    d = config_to_dict(Config())
    assert "tie_embeddings" not in d["model"] and d["model"]["preset"] == "tiny"
    assert config_from_dict(d) == Config()
    assert config_to_dict(resolve(Config(), 1))["model"]["tie_embeddings"] is False


# ----------------------------------------------------------------------------- resolve


def test_resolve_derived_values() -> None:
    cfg = parse_args(["--parallel.tp=2", "--train.micro_batch_size=4"])
    r = resolve(cfg, world_size=8)
    assert (r.parallel.dp, r.train.global_batch_size) == (4, 16)
    assert r.model.num_kv_heads == 2 and r.model.ffn_hidden_size == 384  # int(8*128/3)=341 -> 384
    assert r.model.tie_embeddings is False
    assert cfg.parallel.dp == 0 and cfg.model.ffn_hidden_size == 0       # input not mutated
    g = resolve(parse_args(["--model.preset=gpt2-tiny"]), world_size=1).model
    assert (g.num_kv_heads, g.ffn_hidden_size, g.tie_embeddings) == (4, 512, True)
    big = resolve(parse_args(["--model.preset=llama-7b"]), world_size=1).model
    assert big.ffn_hidden_size == 11008 and big.vocab_size == 32000


def test_resolve_is_idempotent() -> None:
    for argv in ([], ["--model.preset=gpt2-small", "--parallel.pp=2", "--train.global_batch_size=64"]):
        once = resolve(parse_args(argv), world_size=4)
        assert resolve(once, world_size=4) == once
    assert resolve(parse_args([]), 1).model.vocab_size == 0              # stays 0 until the tokenizer


def test_micro_batches_per_step() -> None:
    r = resolve(parse_args(["--train.global_batch_size=64", "--train.micro_batch_size=4"]), world_size=2)
    assert micro_batches_per_step(r) == 8
    with pytest.raises(ConfigError, match="resolve"):
        micro_batches_per_step(parse_args([]))


# ----------------------------------------------------------------------------- validation


def _problems(cfg: Config, world_size: int = 1, device_type: str = "cpu") -> str:
    try:
        validate(resolve(cfg, world_size), world_size, device_type)
    except ConfigError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("overrides, world_size, message", [
    ({"model__arch": "bert"}, 1, "model.arch: 'bert' is not one of llama, gpt2"),
    ({"model__kernels": "cuda"}, 1, "model.kernels: 'cuda' is not one of auto, torch, triton"),
    ({"model__recompute": "some"}, 1, "model.recompute: 'some' is not one of none, selective, full"),
    ({"parallel__schedule": "zb"}, 1, "parallel.schedule: 'zb' is not one of 1f1b, gpipe, interleaved"),
    ({"train__dtype": "fp8"}, 1, "train.dtype: 'fp8' is not one of auto, fp32, bf16, fp16"),
    ({"train__device": "tpu"}, 1, "train.device: 'tpu' is not one of auto, cpu, cuda"),
    ({"parallel__backend": "mpi"}, 1, "parallel.backend: 'mpi' is not one of auto, nccl, gloo"),
    ({"parallel__zero": 4}, 1, "parallel.zero must be 0, 1, 2 or 3"),
    ({"model__num_layers": 0}, 1, "model.num_layers must be >= 1, got 0"),
    ({"model__hidden_size": -128}, 1, "model.hidden_size must be >= 1, got -128"),
    ({"train__micro_batch_size": 0}, 1, "train.micro_batch_size must be >= 1, got 0"),
    ({"train__steps": -1}, 1, "train.steps must be >= 1"),
    ({"model__hidden_size": 130}, 1, "model.hidden_size 130 is not divisible by model.num_heads 4"),
    ({"model__num_kv_heads": 3}, 1, "model.num_heads 4 is not divisible by model.num_kv_heads 3"),
    ({"parallel__tp": 2}, 3, "world_size 3 != tp 2 x pp 1 x dp 1 = 2"),
    ({"parallel__dp": 2}, 4, "world_size 4 != tp 1 x pp 1 x dp 2 = 2: set parallel.dp=4"),
    ({"parallel__pp": 3, "train__global_batch_size": 24}, 3,
     "model.num_layers 4 is not divisible by pp x vpp = 3 x 1 = 3"),
    ({"parallel__pp": 2, "parallel__pp_layers": [4], "train__global_batch_size": 16}, 2,
     "parallel.pp_layers has 1 entries but pp x vpp = 2"),
    ({"parallel__pp": 2, "parallel__pp_layers": [4, 0], "train__global_batch_size": 16}, 2,
     "parallel.pp_layers [4, 0]: every stage needs at least 1 layer"),
    ({"parallel__pp": 2, "parallel__pp_layers": [2, 3], "train__global_batch_size": 16}, 2,
     "parallel.pp_layers [2, 3] sums to 5 but model.num_layers is 4"),
    ({"parallel__tp": 3}, 3, "model.num_heads 4 is not divisible by parallel.tp 3"),
    ({"parallel__tp": 4}, 4, "model.num_kv_heads 2 is not divisible by parallel.tp 4"),
    ({"parallel__tp": 2, "model__ffn_hidden_size": 101}, 2,
     "model.ffn_hidden_size 101 is not divisible by parallel.tp 2"),
    ({"parallel__sp": True}, 1, "parallel.sp needs parallel.tp > 1"),
    ({"parallel__sp": True, "parallel__tp": 2, "model__seq_len": 127}, 2,
     "model.seq_len 127 is not divisible by parallel.tp 2"),
    ({"train__global_batch_size": 12}, 1,
     "train.global_batch_size 12 is not divisible by micro_batch_size 8 x dp 1 = 8: use a multiple of 8"),
    ({"parallel__pp": 2}, 2, "only M=1 micro-batches per step for pp=2"),
    ({"parallel__pp": 4, "train__global_batch_size": 16}, 4, "set train.global_batch_size >= 32"),
    ({"parallel__pp": 2, "parallel__vpp": 2, "train__global_batch_size": 32}, 2,
     "parallel.vpp=2 needs parallel.schedule=interleaved"),
    ({"parallel__pp": 2, "parallel__schedule": "interleaved", "train__global_batch_size": 32}, 2,
     "parallel.schedule=interleaved needs parallel.vpp > 1"),
    ({"parallel__vpp": 2, "parallel__schedule": "interleaved"}, 1,
     "parallel.schedule=interleaved needs parallel.pp > 1"),
    ({"parallel__pp": 2, "parallel__vpp": 2, "parallel__schedule": "interleaved",
      "train__global_batch_size": 24}, 2,
     "needs M=3 micro-batches per step to be a multiple of pp=2"),
    ({"checkpoint__interval": 50}, 1, "checkpoint.interval=50 needs checkpoint.dir"),
    ({"checkpoint__load": "latest"}, 1, "checkpoint.load=latest needs checkpoint.dir"),
    ({"data__path": ["a", "b"], "data__weights": [1.0]}, 1, "data.weights has 1 entries but data.path has 2"),
    ({"data__path": ["a"], "data__weights": [-1.0]}, 1, "data.weights [-1.0] must be >= 0"),
    ({"model__seq_len": 1}, 1, "model.seq_len must be >= 2"),
    ({"model__dropout": 1.0}, 1, "model.dropout must be in [0, 1), got 1.0"),
    ({"model__dropout": -0.1}, 1, "model.dropout must be in [0, 1), got -0.1"),
    ({"data__valid_fraction": 1.0}, 1, "data.valid_fraction must be in [0, 1), got 1.0"),
    ({"train__lr": 0.0}, 1, "train.lr must be > 0, got 0.0"),
    ({"train__min_lr": 0.004}, 1, "train.min_lr 0.004 is above train.lr 0.003"),
    ({"parallel__backend": "nccl"}, 1, "parallel.backend=nccl needs CUDA"),
    ({"optimizer__beta2": 1.0}, 1, "optimizer.beta2 must be in [0, 1)"),
])
def test_validation_rules(overrides: dict[str, Any], world_size: int, message: str) -> None:
    assert message in _problems(_cfg(**overrides), world_size)


def test_valid_layouts_pass() -> None:
    assert _problems(_cfg(), 1) == ""
    assert _problems(_cfg(parallel__tp=2, parallel__pp=2, parallel__sp=True, parallel__vpp=2,
                          parallel__schedule="interleaved", parallel__zero=2, train__global_batch_size=64), 8) == ""
    assert _problems(_cfg(parallel__pp=3, parallel__pp_layers=[1, 2, 1], train__global_batch_size=24), 3) == ""
    assert _problems(_cfg(train__min_lr=0.003), 1) == ""      # min_lr == lr (constant LR) is fine
    for dtype in ("fp16", "bf16"):                        # low precision on CPU is allowed
        assert _problems(_cfg(train__dtype=dtype), 1) == ""


def test_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    text = _problems(_cfg(model__kernels="triton"), 1, "cpu")
    assert "set TRITON_INTERPRET=1 or use model.kernels=torch" in text
    assert _problems(_cfg(model__kernels="triton"), 1, "cuda") == ""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _problems(_cfg(model__kernels="triton"), 1, "cpu") == ""


def test_many_problems_in_one_error() -> None:
    text = _problems(_cfg(model__hidden_size=130, parallel__sp=True, train__lr=0.0, checkpoint__interval=5), 1)
    lines = text.splitlines()
    assert lines[0] == "invalid config (4 problems):" and len(lines) == 5
    single = _problems(_cfg(train__lr=0.0), 1)
    assert single == "invalid config: train.lr must be > 0, got 0.0"  # one problem: one line


def test_validate_resolves_unresolved_config() -> None:
    # dp/global batch left at 0 are derived, not reported as "must be >= 1"
    validate(parse_args(["--parallel.tp=2", "--parallel.sp"]), world_size=4)


# ----------------------------------------------------------------------------- device and dtype


def test_resolved_device_and_dtype() -> None:
    import torch

    cfg = parse_args([])
    assert resolved_device(cfg) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolved_device(parse_args(["--train.device=cpu"])) == "cpu"
    assert resolved_dtype(cfg, "cpu") == torch.float32
    assert resolved_dtype(cfg, "cuda") == torch.bfloat16
    assert resolved_dtype(parse_args(["--train.dtype=fp16"]), "cpu") == torch.float16
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="train.device=cpu or auto"):
            resolved_device(parse_args(["--train.device=cuda"]))
