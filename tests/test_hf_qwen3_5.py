"""Hugging Face Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and Qwen3NextForCausalLM both ways through
tools/import_hf.py and tools/export_hf.py (megalite/checkpoint/interop/hf_qwen3_5.py), on tiny configs unlike
transformers' tests: three layer patterns ([linear, linear, full], [linear, full], [full, linear, linear]), value
heads twice the key heads with K != V, head_dim 16 != hidden / heads, partial RoPE (a quarter of each head), a
sequence of 70 (longer than the recurrence's chunk of 64 and not a multiple of it), every weight moved off its init
(the zero-centred norms off 0, so the (1 + w) conversion shows), the MoE's shared expert behind its gate, and in
Qwen3-Next dense layers between MoE ones (decoder_sparse_step 2) and the top-k left unnormalised.

Checked: logits equal transformers'; greedy generation with megalite's recurrent and KV caches equals transformers'
generate; one training step's loss and every weight gradient equal transformers' (a norm's gradient is the same for
w and 1 + w); the export loads into transformers as the same class with the same tensors (norms: w back from 1 + w
up to one fp32 rounding); a Qwen3-Next whose every layer is MoE with the top-k renormalised exports as Qwen3.5-MoE
(the same function); the hub's composite checkpoint (Qwen3_5ForConditionalGeneration: model.language_model.*, a
vision tower and an mtp.* module) imports its text model and says that the mtp module is left behind.

Tolerance: fp32 both sides, the same math in another order (transformers' chunked delta rule vs megalite's, SDPA vs
megalite's attention): ~1e-6 on O(1) logits, so 1e-5; a mapping error (the gate rows not de-interleaved, a norm
without its 1, the key-head grouping of Qwen3-Next's in_proj, RoPE on the wrong dims) moves them by O(0.1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalite.checkpoint.interop.hf_qwen3_5 import export_tensor, rules
from megalite.checkpoint.sharded import read_index
from megalite.inference.load import load_model
from tests.hf_checks import assert_exported_back, assert_one_step
from tests.test_hf_moe import assert_same_greedy
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")

VOCAB, ATOL, SEQ = 64, 1e-5, 70
NORM_ROUNDING = 2.0 ** -23  # (1 + w) - 1 in fp32 is w up to half an ulp of 1
L, F_ = "linear_attention", "full_attention"
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              max_position_embeddings=128, pad_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (transformers' class, config)
    "dense": ("Qwen3_5ForCausalLM", dict(layer_types=[L, L, F_], intermediate_size=24, tie_word_embeddings=True)),
    "moe": ("Qwen3_5MoeForCausalLM", dict(layer_types=[L, F_], **MOE)),
    "next": ("Qwen3NextForCausalLM", dict(layer_types=[F_, L, L], intermediate_size=24, decoder_sparse_step=2,
                                          norm_topk_prob=False, **MOE)),
    "next_all_moe": ("Qwen3NextForCausalLM", dict(layer_types=[L, F_], intermediate_size=24, **MOE))}
CONFIGS = {"Qwen3_5ForCausalLM": "Qwen3_5TextConfig", "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig",
           "Qwen3NextForCausalLM": "Qwen3NextConfig"}


def hf_model(variant: str) -> Any:
    """A transformers-built tiny model, every weight moved off its init."""
    torch.manual_seed(0)
    cls, given = VARIANTS[variant]
    cfg = getattr(transformers, CONFIGS[cls])(**{**COMMON, "num_hidden_layers": len(given["layer_types"]), **given})
    model = getattr(transformers, cls)(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.2 if "norm" in name or "A_log" in name or "dt_bias" in name else 0.05)
                   * torch.randn(p.shape, generator=gen))
    return model.eval()


def _ids(seed: int, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _imported(theirs: Any, tmp_path: Path) -> Path:
    theirs.save_pretrained(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(ckpt), "--quiet"]) == 0
    return ckpt


def _assert_logits(theirs: Any, ckpt: Path) -> torch.Tensor:
    ours, _ = load_model(ckpt)  # built from index.json alone, as tools/generate.py does
    ids = _ids(1)
    with torch.no_grad():
        want, got = theirs(ids).logits, ours(ids)[..., :VOCAB]
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"megalite's logits differ from transformers' by {err:.2e}"
    return want


def _norm_atol(name: str) -> float:
    return NORM_ROUNDING if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or \
        name == "model.norm.weight" else 0.0


@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_import_export_against_transformers(tmp_path: Path, variant: str) -> None:
    theirs = hf_model(variant)
    ckpt = _imported(theirs, tmp_path)
    info = read_index(ckpt)["model"]
    assert (info["attn_output_gate"], info["rope_fraction"], info["qk_norm"], info["layer_types"]) == \
        ("element", 0.25, True, VARIANTS[variant][1]["layer_types"])
    assert info.get("moe_shared_gate", False) == (variant != "dense")
    want = _assert_logits(theirs, ckpt)
    assert_same_greedy(load_model(ckpt)[0], theirs)  # the linear layers' conv window and state, the full one's KV

    back = assert_exported_back(theirs, ckpt, tmp_path / "export", _norm_atol)  # the round trip, tensor by tensor
    with torch.no_grad():
        torch.testing.assert_close(back(_ids(1)).logits, want, rtol=0, atol=ATOL)


def _grad_layout(name: str, g: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    """A gradient as transformers stores its tensor: the export's layout, but a norm's gradient is w's (no - 1)."""
    return g if name.endswith("norm.weight") else export_tensor(name, g, info)


@pytest.mark.parametrize("variant", ["dense", "next"])
def test_training_step_equals_transformers(tmp_path: Path, variant: str) -> None:
    """One step's loss and every weight gradient (the gate rows of q_proj, the grouped in_proj, the shared expert's
    gate) equal transformers'."""
    theirs = hf_model(variant)
    assert_one_step(theirs, _imported(theirs, tmp_path), _ids(2, SEQ + 1), rules, _grad_layout, ATOL)


def test_qwen3_next_of_moe_layers_only_exports_as_qwen3_5_moe(tmp_path: Path) -> None:
    """Qwen3-Next with a MoE on every layer and the top-k renormalised computes what Qwen3.5-MoE does: the import
    reads its grouped in_proj_qkvz / in_proj_ba by Qwen3.5's names, the export writes a Qwen3_5MoeForCausalLM with
    the same logits."""
    theirs = hf_model("next_all_moe")
    ckpt = _imported(theirs, tmp_path)
    want = _assert_logits(theirs, ckpt)
    from tools.export_hf import main as export_main

    assert export_main(["--input", str(ckpt), "--output", str(tmp_path / "export"), "--quiet"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(back(_ids(1)).logits, want, rtol=0, atol=ATOL)


def test_hub_composite_checkpoint_imports_its_text_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The hub's Qwen3.5 layout: config model_type qwen3_5 with the text model's config in text_config, weights
    under model.language_model.*, a vision tower (model.visual.*) and one MTP layer (mtp.*): the import reads the
    text model (the same logits) and names the MTP module it leaves behind."""
    theirs = hf_model("dense")
    theirs.save_pretrained(tmp_path / "flat")
    tensors = load_file(tmp_path / "flat" / "model.safetensors")
    hub = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
           for k, v in tensors.items()}
    hub |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(32, 64)}
    (tmp_path / "hub").mkdir()
    save_file(hub, tmp_path / "hub" / "model.safetensors")
    text = json.loads((tmp_path / "flat" / "config.json").read_text())
    (tmp_path / "hub" / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "tie_word_embeddings": True, "text_config": {**text, "mtp_num_hidden_layers": 1}, "vision_config": {}}))
    capsys.readouterr()
    ckpt = tmp_path / "ckpt"
    assert import_main(["--input", str(tmp_path / "hub"), "--output", str(ckpt), "--quiet"]) == 0
    assert "multi-token prediction module (mtp.*, 1 layer(s)) is not imported" in capsys.readouterr().err
    _assert_logits(theirs, ckpt)
