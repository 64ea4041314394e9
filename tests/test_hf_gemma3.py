"""Hugging Face Gemma3ForCausalLM (text) both ways through tools/import_hf.py and tools/export_hf.py
(megalite/checkpoint/interop/hf_gemma3.py), on tiny configs unlike transformers' tests: a 4-token window at 16 tokens
(it bites), two layer patterns (3 local : 1 global, and global first), local and global RoPE bases apart,
query_pre_attn_scalar 24 != head_dim 16, head_dim != hidden / heads, every norm weight moved off Gemma's zero (so
the (1 + w) conversion shows), and in one of them the final-logit soft-cap, attention biases and an untied head
(and Gemma 2's attn_logit_softcapping, which transformers' Gemma 3 reads but never applies: nor does the import).

Checked: logits and KV-cached greedy generation equal transformers'; one training step's loss and every weight
gradient equal transformers' (a norm's gradient is the same for w and 1 + w); the export loads into transformers
with the same tensors (norms: w back from 1 + w, up to one fp32 rounding) and logits; a megalite-built Gemma 3
exports; what transformers' Gemma 3 cannot compute is refused by name, and so is a megalite model with a layer
pattern no HF family megalite writes computes.

Tolerance: fp32 both sides, the same math in another order (SDPA vs megalite's attention, GeGLU fused or not):
~1e-6 on O(1) logits, so 1e-5; a mapping error (a norm without its 1, pre- and post-norms swapped, the local RoPE
base on a global layer, the window off by one) moves them by O(0.1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megalite.checkpoint.interop.hf_gemma3 import rules
from megalite.checkpoint.sharded import read_index
from megalite.errors import CheckpointError
from megalite.inference.load import load_model
from tests.hf_checks import assert_exported_back, assert_imports_refused, assert_one_step
from tests.test_hf_moe import assert_same_greedy
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")

VOCAB, ATOL, SEQ = 64, 1e-5, 16
NORM_ROUNDING = 2.0 ** -23  # (1 + w) - 1 in fp32 is w up to half an ulp of 1
S, F_ = "sliding_attention", "full_attention"
VARIANTS: dict[str, dict[str, Any]] = {
    "local3_global1": dict(layer_types=[S, S, S, F_]),
    "global_first_softcapped": dict(layer_types=[F_, S, S], attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    attention_bias=True, tie_word_embeddings=False)}


def hf_model(variant: str, **over: Any) -> Any:
    """A transformers-built tiny Gemma 3, every weight (norms too) moved off its init."""
    torch.manual_seed(0)
    given = {**VARIANTS[variant], **over}
    cfg = transformers.Gemma3TextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=len(given["layer_types"]),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=64,
        query_pre_attn_scalar=24, rope_parameters={F_: {"rope_type": "default", "rope_theta": 1e6},
                                                   S: {"rope_type": "default", "rope_theta": 1e4}}), **given})
    model = transformers.Gemma3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.2 if "norm" in name else 0.05) * torch.randn(p.shape, generator=gen))
    return model.eval()


def _ids(seed: int, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _imported(theirs: Any, tmp_path: Path) -> Path:
    theirs.save_pretrained(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(ckpt), "--quiet"]) == 0
    return ckpt


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_export_against_transformers(tmp_path: Path, variant: str) -> None:
    theirs = hf_model(variant)
    ckpt = _imported(theirs, tmp_path)
    info = read_index(ckpt)["model"]
    assert (info["layer_types"], info["sliding_window"], info["rope_theta"], info["rope_local_theta"]) == \
        ({"local3_global1": [S, S, S, F_], "global_first_softcapped": [F_, S, S]}[variant], 4, 1e6, 1e4)
    assert info["sandwich_norm"] and info["embed_scale"] and info["qk_norm"] and info["query_pre_attn_scalar"] == 24
    # transformers' Gemma 3 never applies attn_logit_softcapping (Gemma 2's); the final soft-cap it does
    assert "attn_softcap" not in info and info.get("final_softcap") == VARIANTS[variant].get("final_logit_softcapping")
    ours, _ = load_model(ckpt)  # built from index.json alone, as tools/generate.py does
    ids = _ids(1)
    with torch.no_grad():
        want, got = theirs(ids).logits, ours(ids)[..., :VOCAB]
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"{variant}: megalite's logits differ from transformers' by {err:.2e}"

    assert_same_greedy(ours, theirs)  # 11 positions through a 4-token window: the cache must drop keys

    # norms: w back from 1 + w up to one fp32 rounding; the rest bit for bit
    back = assert_exported_back(theirs, ckpt, tmp_path / "export",
                                lambda name: NORM_ROUNDING if name.endswith("norm.weight") else 0.0)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=0, atol=ATOL)


def test_training_step_equals_transformers(tmp_path: Path) -> None:
    """One step's loss and every weight gradient equal transformers' (no padding row: transformers' embedding would
    give token 0 no gradient; megalite's export writes pad_token_id null for that reason)."""
    theirs = hf_model("global_first_softcapped", pad_token_id=None)
    assert_one_step(theirs, _imported(theirs, tmp_path), _ids(2, SEQ + 1), rules, lambda name, g, info: g, ATOL)


BAD_IMPORTS: list[tuple[dict[str, Any], str]] = [  # (config overrides, what the one line names)
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention must be false"),
    ({"hidden_activation": "relu"}, "hidden_activation must be gelu_pytorch_tanh"),
    ({"rope_parameters": {F_: {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
                               "original_max_position_embeddings": 32}, S: {"rope_type": "default"}}},
     "its global and local layers scale RoPE differently"),
    ({"rope_parameters": {F_: {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}, S: {}}},
     "rope scaling 'linear'"),
    ({"layer_types": [S, S]}, "layer_types must list"),
    ({"model_type": "gemma3"}, "Gemma3ForConditionalGeneration"),
]


def test_bad_configs_one_line_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf_model("local3_global1").save_pretrained(tmp_path / "hf")
    assert_imports_refused(tmp_path / "hf", BAD_IMPORTS, tmp_path, capsys)


def test_megalite_models_export_or_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A megalite-built Gemma 3 (tests/layer_pattern_utils.py's: soft-caps that bend, query_pre_attn_scalar 10)
    loads into transformers and computes its logits. A model no HF family megalite writes computes (a Llama with
    sliding windows, a Gemma without q/k norm) is one line naming what is missing, and nothing is written."""
    from tests.layer_pattern_utils import gated_cfg, gemma3_cfg
    from tests.test_hf_gpt_oss import _saved_megalite

    model, ckpt = _saved_megalite(gemma3_cfg(attn_softcap=0.0), tmp_path / "ckpt")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # megalite's norms start at 1: move them (HF's 0) off it
                p.add_(0.2 * torch.randn(p.shape))
    from megalite.checkpoint.sharded import save_sharded
    from megalite.parallel.state import ParallelState

    ckpt = save_sharded(tmp_path / "moved", 1, model, None, {}, ParallelState(), keep=0)
    assert read_index(ckpt)["model"]["final_softcap"] == 2.0
    out = tmp_path / "hf"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.config.query_pre_attn_scalar == 10 and back.config.final_logit_softcapping == 2.0
    ids = torch.randint(0, 61, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :61], back(ids).logits, atol=ATOL, rtol=0)
    capsys.readouterr()
    for i, (cfg, words) in enumerate([
            (gemma3_cfg(qk_norm=False), "no Gemma3ForCausalLM equivalent: it needs q/k norm (model.qk_norm)"),
            (gemma3_cfg(mlp="swiglu"), "GeGLU (model.mlp=geglu) (has mlp='swiglu')"),
            (gemma3_cfg(), "no attention soft-cap (Gemma 2's) (has attn_softcap=0.5)"),
            (gated_cfg(), "no Hugging Face equivalent megalite writes: model.rope_fraction=0.25"),
            (gemma3_cfg(sandwich_norm=False, embed_scale=False, qk_norm=False, mlp="auto", attn_softcap=0.0,
                        final_softcap=0.0, query_pre_attn_scalar=0.0, rope_local_theta=0.0),
             "model.layer_types=['sliding_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention', "
             "'sliding_attention', 'full_attention'], model.sliding_window=4")]):
        _, ckpt = _saved_megalite(cfg, tmp_path / f"bad{i}")
        code = export_main(["--input", str(ckpt), "--output", str(tmp_path / f"out{i}"), "--quiet"])
        err = capsys.readouterr().err.strip()
        assert code == CheckpointError.exit_code and words in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / f"out{i}").exists()


def test_init_from_takes_the_hf_directory(tmp_path: Path) -> None:
    """`train.init_from` imports a Gemma 3 directory through the same MAPPING as tools/import_hf.py, and the run
    builds its layer pattern and variants from the import (checkpoint.model_shape), refusing a contradicting flag."""
    from megalite.checkpoint.model_shape import apply_checkpoint_shape
    from megalite.config.schema import Config
    from megalite.training.init_from import resolve_init_from

    hf_model("local3_global1").save_pretrained(tmp_path / "hf")
    path = resolve_init_from(str(tmp_path / "hf"), cache_dir=str(tmp_path / "cache"))
    m = apply_checkpoint_shape(Config(), [], init_from=path).model
    assert (m.layer_types, m.sliding_window, m.rope_local_theta, m.sandwich_norm, m.embed_scale, m.mlp, m.qk_norm) == \
        ([S, S, S, F_], 4, 1e4, True, True, "geglu", True)
    cfg = Config()
    cfg.model.sliding_window = 8
    with pytest.raises(CheckpointError, match="model.sliding_window=8 but the checkpoint has 4"):
        apply_checkpoint_shape(cfg, ["--model.sliding_window", "8"], init_from=path)


def test_older_config_format_reads_the_same(tmp_path: Path) -> None:
    """The hub's older Gemma 3 config.json (rope_theta, rope_local_base_freq, sliding_window_pattern, no layer_types
    or rope_parameters: google/gemma-3-1b-pt's) imports to the same model as transformers 5's format."""
    import json

    from tests.hf_checks import import_with_config

    theirs = hf_model("local3_global1")
    new = read_index(_imported(theirs, tmp_path))["model"]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        del cfg[key]
    cfg |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 4, "rope_scaling": None}
    assert import_with_config(tmp_path / "hf", cfg, tmp_path / "old")["model"] == new
