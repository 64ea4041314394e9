"""Model dims from the checkpoint: `--checkpoint.load X` alone builds X's model (megalite or imported HF);
flags (CLI, TOML, preset) that contradict X are refused naming every differing field."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalite.checkpoint.interop.hf import import_hf
from megalite.checkpoint.model_shape import SHAPE_FIELDS
from megalite.checkpoint.sharded import save_sharded
from megalite.config import ModelArgs, resolve
from megalite.errors import CheckpointError
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from megalite.training.trainer import main, setup_config

# Every field differs from the defaults (and from the "tiny" preset), so a field not taken shows.
SHAPE = dict(arch="llama", num_layers=3, hidden_size=48, num_heads=6, num_kv_heads=2, ffn_hidden_size=96,
             vocab_size=300, seq_len=24, tie_embeddings=True, norm_eps=1e-6, rope_theta=50000.0,
             make_vocab_divisible_by=16)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = ModelArgs(**SHAPE, kernels="torch")
    path = tmp_path_factory.mktemp("shape") / "ckpt"
    save_sharded(path, 1, GPT(cfg, ParallelState(), seed=1), None, {}, ParallelState(), keep=1)
    return path


def test_shape_taken_from_checkpoint(ckpt: Path) -> None:
    cfg, _ = setup_config(["--checkpoint.load", str(ckpt)])
    assert {k: getattr(cfg.model, k) for k in SHAPE} == SHAPE
    # Matching flags are fine; non-shape model flags (dropout, kernels) are untouched.
    cfg, _ = setup_config(["--checkpoint.load", str(ckpt), "--model.rope_theta", "50000", "--model.num_layers", "3",
                           "--model.dropout", "0.1", "--model.num_kv_heads", "0"])
    assert cfg.model.dropout == 0.1 and cfg.model.num_kv_heads == 2 and cfg.model.rope_theta == 50000.0


@pytest.mark.parametrize("flags,fields", [
    (["--model.rope_theta", "10000"], ["rope_theta"]),
    (["--model.norm_eps", "1e-5", "--model.seq_len", "32", "--model.num_layers", "4"],
     ["num_layers", "seq_len", "norm_eps"]),
    (["--model.preset", "llama-160m"], ["num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "seq_len"]),
])
def test_contradicting_flags_refused_naming_each(ckpt: Path, flags: list[str], fields: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CheckpointError) as err:
        setup_config(flags + ["--checkpoint.load", str(ckpt)])
    named = [f for f in SHAPE_FIELDS if f"model.{f}=" in str(err.value)]
    assert named == [f for f in SHAPE_FIELDS if f in fields]
    assert main(flags + ["--checkpoint.load", str(ckpt)]) == CheckpointError.exit_code
    out = capsys.readouterr().err
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out


def test_toml_values_count_as_given(ckpt: Path, tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nnorm_eps = 1e-5\n\n[checkpoint]\nload = "' + str(ckpt) + '"\n')
    with pytest.raises(CheckpointError, match=r"model.norm_eps=1e-05 but the checkpoint has 1e-06"):
        setup_config(["--config", str(toml)])


def test_imported_hf_model_shape(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf")
    out = import_hf(tmp_path / "hf", tmp_path / "ckpt", show_progress=False)
    cfg, _ = setup_config(["--checkpoint.load", str(out)])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size, m.seq_len,
            m.norm_eps, m.rope_theta, m.tie_embeddings) == (2, 32, 4, 2, 80, 128, 64, 1e-6, 50000.0, False)
    # The example: resuming without the flag no longer silently trains rope_theta=10000.
    with pytest.raises(CheckpointError, match="rope_theta"):
        setup_config(["--checkpoint.load", str(out), "--model.rope_theta", "10000"])
    assert resolve(cfg, 1).model.rope_theta == 50000.0


def test_tokenizer_larger_than_checkpoint_vocab(ckpt: Path, demo_cache_dir: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint's vocab_size (300) is the model's now: the demo tokenizer's 512 ids do not fit."""
    code = main(["--data.cache_dir", demo_cache_dir, "--data.demo_max_bytes", "300000", "--data.demo_vocab_size",
                 "512", "--checkpoint.load", str(ckpt), "--logging.dir", str(ckpt.parent / "run")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (not the demo build note)
    assert code == 3 and len(errors) == 1 and "512 tokens but model.vocab_size=300" in errors[0]
