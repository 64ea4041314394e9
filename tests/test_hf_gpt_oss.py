"""Hugging Face GptOssForCausalLM both ways through tools/import_hf.py and tools/export_hf.py
(megalite/checkpoint/interop/hf_gpt_oss.py), on tiny configs unlike transformers' tests: a 4-token window at 16
tokens (it bites), three layer patterns, sinks drawn N(0.5, 1) (far from their zero-centred init), every bias and
the router bias random, head_dim 16 != hidden / heads, YaRN without truncation (gpt-oss's `truncate: false`).

Checked: logits and KV-cached greedy generation equal transformers'; one training step's loss and every weight
gradient equal transformers'; the export loads into transformers with the very same tensors and logits; the hub's
MXFP4 experts (written here in the hub's format from the same model) are dequantised exactly as transformers does
(the dequantiser on a crafted tensor of every code and scale; the whole model against transformers' own
dequantising load); a megalite-built gpt-oss exports; what transformers' gpt-oss cannot compute is refused by name.

Tolerance: fp32 both sides, the same math in another order (eager vs SDPA-style attention with the sink, grouped vs
per-expert GEMMs): ~1e-6 on O(1) logits, so 1e-5; a mapping error (gate vs up interleaving, a transposed expert, a
sink or bias dropped, a window off by one) moves them by O(0.1). The MXFP4 dequantiser is compared bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalite.checkpoint.interop.hf_gpt_oss import FP4_VALUES, dequantize_mxfp4, export_tensor, rules
from megalite.checkpoint.sharded import read_index
from megalite.errors import CheckpointError
from megalite.inference.load import load_model
from tests.hf_checks import assert_exported_back, assert_imports_refused, assert_one_step
from tests.test_hf_moe import assert_same_greedy
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")

VOCAB, ATOL, SEQ = 64, 1e-5, 16
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}
PATTERNS = {"alternating": None,  # transformers' default: sliding, full, sliding, ...
            "full_first": ["full_attention", "sliding_attention", "sliding_attention"],
            "all_sliding": ["sliding_attention", "sliding_attention"]}


def hf_model(layer_types: list[str] | None = None, **over: Any) -> Any:
    """A transformers-built tiny gpt-oss, every weight moved off its init, sinks far from zero."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=len(layer_types or [0, 0]),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, max_position_embeddings=64, layer_types=layer_types, rope_parameters=ROPE,
        tie_word_embeddings=False, pad_token_id=None), **over})
    model = transformers.GptOssForCausalLM(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(0.5 + torch.randn(p.shape, generator=gen))
            else:
                p.add_((0.2 if "norm" in name or "router" in name else 0.05) * torch.randn(p.shape, generator=gen))
    return model.eval()


def _ids(seed: int, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _imported(theirs: Any, tmp_path: Path, name: str = "hf") -> Path:
    theirs.save_pretrained(tmp_path / name)
    ckpt = tmp_path / f"ckpt_{name}"
    assert import_main(["--input", str(tmp_path / name), "--output", str(ckpt), "--quiet"]) == 0
    return ckpt


def _assert_logits(ours: Any, theirs: Any, seed: int = 1) -> torch.Tensor:
    ids = _ids(seed)
    with torch.no_grad():
        want, got = theirs(ids).logits, ours(ids)[..., :VOCAB]
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"megalite's logits differ from transformers' by {err:.2e}"
    return want


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_import_export_against_transformers(tmp_path: Path, pattern: str) -> None:
    theirs = hf_model(PATTERNS[pattern])
    ckpt = _imported(theirs, tmp_path)
    info = read_index(ckpt)["model"]
    want_types = {"alternating": ["sliding_attention", "full_attention"], "full_first": PATTERNS["full_first"],
                  "all_sliding": ["sliding_attention"]}[pattern]
    assert (info["layer_types"], info["sliding_window"], info["rope_truncate"]) == (want_types, 4, False)
    assert info["attn_sinks"] and info["attn_bias"] and info["moe_router_bias"] and info["mlp"] == "clamped_swiglu"
    ours, _ = load_model(ckpt)  # built from index.json alone, as tools/generate.py does
    want = _assert_logits(ours, theirs)

    assert_same_greedy(ours, theirs)  # 11 positions through a 4-token window: the cache must drop keys

    back = assert_exported_back(theirs, ckpt, tmp_path / "export")  # copies, a transpose, a permutation: exact
    with torch.no_grad():
        assert torch.equal(back(_ids(1)).logits, want)


def test_training_step_equals_transformers(tmp_path: Path) -> None:
    """One step's loss and every weight gradient (mapped to transformers' tensors) equal transformers'."""
    theirs = hf_model(PATTERNS["full_first"])
    assert_one_step(theirs, _imported(theirs, tmp_path), _ids(2, SEQ + 1), rules, export_tensor, ATOL)


# ------------------------------------------------------------------------------------------------- MXFP4
def test_mxfp4_dequantiser_equals_transformers() -> None:
    """Every byte (both nibbles) under scales from 2^-127 to 2^127 (overflow to inf included), bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    assert list(FP4_VALUES) == [float(v) for v in transformers.integrations.mxfp4.FP4_VALUES]
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 2, 4, 16)  # [E, rows, G, 16]
    scales = torch.tensor([0, 1, 100, 126, 127, 128, 160, 254] * 2, dtype=torch.uint8).reshape(2, 2, 4)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G x 32, rows]
    ours = torch.stack([dequantize_mxfp4(blocks[e], scales[e]).t() for e in range(2)])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    assert ours.isinf().any() and (ours != 0).all() == False  # noqa: E712 (the extremes are really there)


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, rows, in] quantised to MXFP4 as the hub stores it: each 32 inputs share a power of two that brings
    their largest magnitude within FP4's 6, each value rounded to the nearest FP4 value."""
    e, rows, n = w.shape
    groups = w.reshape(e, rows, n // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0 ** -60) / 6.0))
    scaled = groups / torch.exp2(exp)[..., None]
    mags = torch.tensor(FP4_VALUES[:8])
    codes = ((scaled.abs()[..., None] - mags).abs().argmin(-1) + 8 * (scaled < 0)).to(torch.uint8)
    codes = codes.reshape(e, rows, n // 32, 16, 2)
    return codes[..., 0] | (codes[..., 1] << 4), (exp + 127).to(torch.uint8)


def test_hub_mxfp4_experts_dequantised_like_transformers(tmp_path: Path) -> None:
    """The model's experts written as the hub's MXFP4 release imports to transformers' logits on that release
    (transformers' own loader, dequantising), and differs from the unquantised model (the copy is really FP4)."""
    theirs = hf_model()
    theirs.save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(tensors.pop(name).transpose(1, 2))  # the hub's rows: the output dim
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file(tensors, str(hub / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (hub / "config.json").write_text(json.dumps(cfg))
    ckpt = tmp_path / "ckpt"
    assert import_main(["--input", str(hub), "--output", str(ckpt), "--quiet"]) == 0
    ours, _ = load_model(ckpt)
    dequantised = transformers.AutoModelForCausalLM.from_pretrained(
        hub, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    want = _assert_logits(ours, dequantised)
    with torch.no_grad():
        assert (theirs(_ids(1)).logits - want).abs().max() > 1e-3  # FP4 rounding changed the model


# ------------------------------------------------------------------------------------------------- refusals
BAD_IMPORTS: list[tuple[dict[str, Any], str]] = [  # (config overrides, what the one line names)
    ({"quantization_config": {"quant_method": "fp8"}}, "is not the hub's MXFP4"),
    ({"layer_types": ["full_attention"]}, "layer_types must list"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types must list"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than the 4 experts"),
    ({"swiglu_limit": 0}, "swiglu_limit=0 must be a positive number"),
    ({"rope_parameters": {**ROPE, "rope_type": "longrope"}}, "rope scaling 'longrope'"),
]


def test_bad_configs_one_line_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf_model().save_pretrained(tmp_path / "hf")
    assert_imports_refused(tmp_path / "hf", BAD_IMPORTS, tmp_path, capsys)


def _saved_megalite(cfg: Any, path: Path) -> tuple[Any, Path]:
    """A megalite-built model of `cfg` (its own init, biases and sinks moved off zero), saved as a checkpoint."""
    from megalite.checkpoint.sharded import save_sharded
    from megalite.model.gpt import GPT
    from megalite.parallel.state import ParallelState
    from tests.layer_pattern_utils import perturb

    st = ParallelState()
    model = GPT(cfg, st, seed=4).eval()
    perturb(model, st)
    return model, save_sharded(path, 1, model, None, {}, st, keep=0)


def test_megalite_gpt_oss_exports(tmp_path: Path) -> None:
    """A megalite-built gpt-oss (tests/layer_pattern_utils.py's: the clamp reached at init) loads into transformers
    and computes its logits, and its bf16 export is those tensors in bf16; one without expert biases has no GptOss
    equivalent and is refused by name."""
    from tests.layer_pattern_utils import gpt_oss_cfg

    model, ckpt = _saved_megalite(gpt_oss_cfg(), tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.config.swiglu_limit == 0.3 and back.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    ids = torch.randint(0, 61, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :61], back(ids).logits, atol=ATOL, rtol=0)
    half = tmp_path / "hf_bf16"  # --dtype bf16: the same tensors rounded to bf16, which transformers loads as such
    assert export_main(["--input", str(ckpt), "--output", str(half), "--dtype", "bf16", "--quiet"]) == 0
    halved = transformers.AutoModelForCausalLM.from_pretrained(half).state_dict()
    assert all(torch.equal(halved[k], v.to(torch.bfloat16)) for k, v in back.state_dict().items())
    _, ckpt = _saved_megalite(gpt_oss_cfg(mlp_bias=False), tmp_path / "nobias")
    assert export_main(["--input", str(ckpt), "--output", str(tmp_path / "no"), "--quiet"]) == \
        CheckpointError.exit_code
    assert not (tmp_path / "no").exists()


# The released configs' fields the presets must reproduce (openai/gpt-oss-20b, google/gemma-3-1b-pt config.json).
RELEASED: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                        sliding_window=128, vocab_size=201088, rms_norm_eps=1e-5, swiglu_limit=7.0,
                        attention_bias=True, tie_word_embeddings=False,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                             beta_slow=1.0, original_max_position_embeddings=4096, truncate=False)),
    "gemma3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144, rms_norm_eps=1e-6,
                      query_pre_attn_scalar=256, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")}


@pytest.mark.parametrize("preset", list(RELEASED))
def test_real_presets_export_the_released_configs(preset: str) -> None:
    """The gpt-oss-20b and gemma3-1b presets (megalite/config/presets.py) export to the released config.json's
    fields and layer pattern; transformers builds from it (on the meta device) exactly the tensors the export
    writes, shape for shape; and the import reads that config back to the same model fields."""
    from megalite.checkpoint.interop.hf import _swapped
    from megalite.checkpoint.interop.hf_families import MAPPING
    from megalite.checkpoint.layout import model_info
    from megalite.config import ModelArgs, parse_args, resolve
    from megalite.config.schema import ModelConfig

    info = model_info(ModelArgs.from_config(resolve(parse_args(["--model.preset", preset]), 1)))
    config = MAPPING.hf_config(info)
    assert {k: config[k] for k in RELEASED[preset]} == RELEASED[preset]
    n = config["num_hidden_layers"]
    want_types = (["sliding_attention", "full_attention"] * n if preset == "gpt-oss-20b" else
                  (["sliding_attention"] * 5 + ["full_attention"]) * n)[:n]
    assert config["layer_types"] == want_types
    if preset == "gemma3-1b":
        assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
        assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    kind = transformers.GptOssConfig if preset == "gpt-oss-20b" else transformers.Gemma3TextConfig
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(kind(**config))
    theirs = {k: tuple(v.shape) for k, v in built.state_dict().items() if k != "lm_head.weight" or
              not config["tie_word_embeddings"]}
    shapes = MAPPING.expected_shapes(info)
    ours = {}
    for name, hf_names, split, transposed in MAPPING.rules(info):
        for hf_name, rows in zip(hf_names, split or [shapes[name][0]]):
            s = (rows,) + shapes[name][1:]
            ours[hf_name] = _swapped(s) if transposed else s
    assert ours == theirs
    back = MAPPING.info_from_hf(config)
    if "moe_experts" in info:  # 0 = the model's FFN width, which the import writes out; the bias rate is deepseek's
        info = {**info, "moe_ffn_hidden_size": info["moe_ffn_hidden_size"] or info["ffn_hidden_size"],
                "moe_bias_rate": back["moe_bias_rate"]}
    assert {k: back[k] for k in info if k in back} == {k: info[k] for k in info if k in back}
    # what the import leaves out is at its default (another scaling's rope_* fields), or a training loss HF configs
    # have no field for
    missing = set(info) - set(back)
    assert all(k == "moe_seq_aux_loss" or info[k] == getattr(ModelConfig(), k) for k in missing), missing


def test_hub_config_format_reads_the_same(tmp_path: Path) -> None:
    """openai/gpt-oss-20b's config.json names its YaRN `rope_scaling` beside a top-level rope_theta (and says
    experts_per_token too): the same model as transformers 5's rope_parameters."""
    from tests.hf_checks import import_with_config

    theirs = hf_model()
    new = read_index(_imported(theirs, tmp_path))["model"]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope, "experts_per_token": 2}
    assert import_with_config(tmp_path / "hf", cfg, tmp_path / "old")["model"] == new
