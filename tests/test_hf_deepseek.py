"""Hugging Face DeepseekV3ForCausalLM both ways through tools/import_hf.py and tools/export_hf.py
(megalite/checkpoint/interop/hf_deepseek.py), on a tiny config unlike transformers' tests: top-2 of 8 experts in
4 groups of which 2 are kept (the group limit filters), a non-zero correction bias, a shared expert, layer 0 dense
(first_k_dense_replace 1), v_head_dim 12 != the q/k head dim 24, YaRN, with and without the low-rank query.

Checked: logits and greedy generation equal transformers'; one training step's loss and every weight gradient equal
transformers' (the router's correction bias is a buffer: no gradient either side); the export loads into
transformers with the very same tensors (the bias included) and the re-import is the same checkpoint; the hub's
per-expert names and transformers' fused tensors both read; the MTP layer written as the hub does
(`model.layers.{L}.enorm` ...), which transformers skips on load, read back tensor for tensor and its losses
equal to the paper's formulas; DeepSeek's block-FP8 release dequantised on import.

Tolerance: fp32 both sides, the same math in another order (SDPA vs eager attention, grouped vs per-expert
GEMMs): ~1e-6 on O(1) logits, so 1e-5; a mapping error (a RoPE row order, gate vs up, an expert, the bias) is O(0.1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalite.checkpoint.interop.hf_deepseek import export_tensor, rules
from megalite.checkpoint.sharded import load_sharded, read_index, save_sharded
from megalite.checkpoint.storage import SlabReader
from megalite.inference.load import load_model, model_config_from_info
from megalite.model.gpt import GPT
from megalite.mtp.config import MTPConfig
from megalite.parallel.state import ParallelState
from tests.hf_checks import assert_one_step
from tests.parallel_utils import with_sections
from tests.test_hf_moe import assert_same_greedy
from tools.export_hf import main as export_main
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")

VOCAB, ATOL = 64, 1e-5
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
            mscale=0.707, mscale_all_dim=1.0)


def hf_config(q_lora: int | None = 24, **over: Any) -> Any:
    return transformers.DeepseekV3Config(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, **YARN}), **over})


def hf_model(q_lora: int | None = 24) -> Any:
    """A transformers-built tiny DeepseekV3, every weight moved off its init, a non-zero correction bias and a
    router spread wide enough that the group limit changes choices."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_config(q_lora))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.2 if "norm" in name else 0.05) * torch.randn(p.shape, generator=gen))
            if name.endswith("gate.weight"):
                p.mul_(20)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.eval()


def _ids(seed: int, n: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    index = read_index(ckpt)
    reader = SlabReader(ckpt, index)
    try:
        return {k: reader.read_region(k, (0,) * len(reader.shape(k)), reader.shape(k)) for k in index["tensors"]
                if k.startswith(("param/", "buffer/"))}
    finally:
        reader.close()


def _group_limit_filters(theirs: Any, ids: torch.Tensor) -> None:
    """The tiny config really exercises group limiting: some token's chosen experts differ from a plain top-k."""
    gate = theirs.model.layers[1].mlp.gate
    h = theirs.model.embed_tokens(ids).reshape(-1, 64)
    _, _, chosen = gate(h)
    plain = (h @ gate.weight.t()).sigmoid() + gate.e_score_correction_bias
    assert not torch.equal(chosen.sort(-1).values, plain.topk(2).indices.sort(-1).values)


@pytest.mark.parametrize("q_lora", [24, None])
def test_import_export_against_transformers(tmp_path: Path, q_lora: int | None) -> None:
    theirs = hf_model(q_lora)
    theirs.save_pretrained(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(ckpt), "--quiet"]) == 0
    info = read_index(ckpt)["model"]
    assert info["mla"]["q_lora_rank"] == (q_lora or 0) and info["moe_router"] == "deepseek"
    assert (info["moe_groups"], info["moe_group_top_k"], info["moe_first_dense"]) == (4, 2, 1)
    ours, _ = load_model(ckpt)  # built from index.json alone, as tools/generate.py does
    ids = _ids(1)
    _group_limit_filters(theirs, ids)
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids)[..., :VOCAB]
    assert (got - want).abs().max().item() <= ATOL

    assert_same_greedy(ours, theirs)  # megalite.inference's KV-cached decoder (tools/generate.py's)

    out = tmp_path / "export"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 0
    written = load_file(str(out / "model.safetensors"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in written  # transformers' fused layout
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    mine, orig = back.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(orig)
    for name, value in orig.items():
        assert torch.equal(mine[name], value), name  # fp32 copies and a permutation: exact, the bias included
    # The fused layout reads back to the same checkpoint as the hub's per-expert names did.
    again = tmp_path / "again"
    assert import_main(["--input", str(out), "--output", str(again), "--quiet"]) == 0
    first, second = _checkpoint_tensors(ckpt), _checkpoint_tensors(again)
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)


def test_training_step_equals_transformers(tmp_path: Path) -> None:
    """One step's loss and every weight gradient (mapped to the hub's tensors) equal transformers'."""
    theirs = hf_model()
    theirs.save_pretrained(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(ckpt), "--quiet"]) == 0
    assert_one_step(theirs, ckpt, _ids(2, 17), rules, export_tensor, ATOL)
    bias = [b for n, b in theirs.named_buffers() if n.endswith("e_score_correction_bias")]
    assert bias and all(not b.requires_grad for b in bias)


def _tiny_megalite_with_mtp(tmp_path: Path) -> tuple[GPT, Path]:
    """A megalite-built tiny DeepSeek-V3 with one MTP layer (its own init, a non-zero router bias), saved."""
    theirs = hf_model()
    theirs.save_pretrained(tmp_path / "hf")
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "base"), "--quiet"]) == 0
    info = read_index(tmp_path / "base")["model"]
    st = ParallelState()
    model = GPT(with_sections(model_config_from_info(info), mtp=MTPConfig(num_layers=1)), st, seed=5)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("router.bias"):
                b.copy_(0.01 * torch.randn(b.shape))
    return model, save_sharded(tmp_path / "ours", 1, model, None, {}, st, keep=0)


def test_mtp_layer_round_trip_in_the_hub_layout(tmp_path: Path) -> None:
    model, ckpt = _tiny_megalite_with_mtp(tmp_path)
    out = tmp_path / "export"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    written = load_file(str(out / "model.safetensors"))
    mtp = {k for k in written if k.startswith("model.layers.2.")}
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.shared_head.head.weight",
            "model.layers.2.embed_tokens.weight", "model.layers.2.self_attn.kv_b_proj.weight",
            "model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.gate.e_score_correction_bias"} <= mtp
    assert torch.equal(written["model.layers.2.shared_head.head.weight"], written["lm_head.weight"])
    # transformers builds num_hidden_layers decoder layers and skips the MTP layer's tensors on load.
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert len(back.model.layers) == 2 and not any(k.startswith("model.layers.2.") for k in back.state_dict())
    ids = _ids(4)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids)[..., :VOCAB], back(ids).logits, atol=ATOL, rtol=0)
    # megalite -> hub layout -> megalite: the same tensors, the MTP layer's and the router biases included.
    again = tmp_path / "again"
    assert import_main(["--input", str(out), "--output", str(again), "--quiet"]) == 0
    assert read_index(again)["model"]["mtp_layers"] == 1
    first, second = _checkpoint_tensors(ckpt), _checkpoint_tensors(again)
    assert any(k.startswith("param/mtp.layers.0.") for k in first)
    assert sorted(first) == sorted(second)
    for k in first:
        assert torch.equal(first[k], second[k]), k

    # The re-imported MTP losses are the paper's (tests/test_mtp.py's reference, written from eq. 21-25).
    from tests import test_mtp

    info = read_index(again)["model"]
    reread = GPT(with_sections(model_config_from_info(info), mtp=MTPConfig(num_layers=1, loss_weight=test_mtp.LAMBDA)),
                 ParallelState(), seed=0).train()
    load_sharded(again, reread, None, ParallelState(), weights_only=True)
    ids = _ids(6, 17)
    reread(ids[:, :-1], ids[:, 1:]).mean().backward()
    old = test_mtp.D
    test_mtp.D = 1
    try:
        want, losses = test_mtp._reference_loss(reread, ids[:, :-1], ids[:, 1:])
    finally:
        test_mtp.D = old
    assert reread.mtp is not None
    assert abs(reread.mtp.sums[0] - float(losses[0].detach())) <= ATOL


def test_dense_tied_mla_model_exports_as_deepseek_v3(tmp_path: Path) -> None:
    """A megalite model with MLA and no MoE (every layer before first_k_dense_replace) and tied embeddings exports
    as DeepseekV3 with its logits, and imports back to the same checkpoint."""
    from megalite.mla.config import MLAConfig
    from tests.parallel_utils import tiny_model_cfg

    cfg = tiny_model_cfg(vocab_size=VOCAB, hidden_size=64, num_heads=4, num_kv_heads=4, seq_len=32, norm_eps=1e-6,
                         make_vocab_divisible_by=1, tie_embeddings=True, rope_scaling="yarn", rope_factor=4.0,
                         rope_original_max_positions=8, rope_mscale=1.0, rope_mscale_all_dim=1.0)
    st = ParallelState()
    model = GPT(with_sections(cfg, mla=MLAConfig(kv_lora_rank=16, q_lora_rank=0, qk_rope_head_dim=8,
                                                 qk_nope_head_dim=16, v_head_dim=12)), st, seed=7).eval()
    ckpt = save_sharded(tmp_path / "ours", 1, model, None, {}, st, keep=0)
    out = tmp_path / "export"
    assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids(8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), back(ids).logits, atol=ATOL, rtol=0)
    assert import_main(["--input", str(out), "--output", str(tmp_path / "again"), "--quiet"]) == 0
    first, second = _checkpoint_tensors(ckpt), _checkpoint_tensors(tmp_path / "again")
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)


def _quantised(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: one scale per 128 x 128 block (amax / 448), the payload in float8_e4m3fn."""
    rows, cols = w.shape
    grid = torch.zeros(-(-rows // 128), -(-cols // 128))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            grid[i, j] = block.abs().amax().clamp(min=1e-12) / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / grid[i, j]).to(torch.float8_e4m3fn)
    return q, grid


def test_deepseek_fp8_release_is_dequantised(tmp_path: Path) -> None:
    """A checkpoint in DeepSeek's released format (per-expert names, linear weights float8 with 128 x 128
    `weight_scale_inv`, quantization_config): the import equals transformers on the dequantised weights."""
    theirs = hf_model()
    theirs.save_pretrained(tmp_path / "hf")
    hub = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in hub  # save_pretrained writes the hub's names
    fp8: dict[str, torch.Tensor] = {}
    for name, w in hub.items():
        big = name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")
        if big and w.dim() == 2:
            q, s = _quantised(w)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            hub[name] = q.float() * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
        else:
            fp8[name] = w
    src = tmp_path / "fp8"
    src.mkdir()
    save_file(fp8, str(src / "model.safetensors"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    ckpt = tmp_path / "ckpt"
    assert import_main(["--input", str(src), "--output", str(ckpt), "--quiet"]) == 0
    plain = tmp_path / "dequantised"  # transformers on the dequantised weights (the hub's names: it stacks them)
    plain.mkdir()
    save_file(hub, str(plain / "model.safetensors"))
    (plain / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    ours, _ = load_model(ckpt)
    ids = _ids(5)
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= ATOL
    assert hub["model.layers.1.mlp.experts.0.gate_proj.weight"].ne(
        load_file(str(tmp_path / "hf" / "model.safetensors"))["model.layers.1.mlp.experts.0.gate_proj.weight"]).any()
    # Without quantization_config the float8 tensors are refused in one line (exit 4), nothing written.
    del cfg["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert import_main(["--input", str(src), "--output", str(tmp_path / "no"), "--quiet"]) == 4
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("over,what", [({"scoring_func": "softmax"}, "scoring_func 'softmax' is not sigmoid"),
                                       ({"rms_norm_eps": 1e-5}, "rms_norm_eps must be 1e-06"),
                                       ({"n_group": 3}, "n_group must divide n_routed_experts"),
                                       ({"first_k_dense_replace": -1}, "first_k_dense_replace must be an integer"),
                                       ({"quantization_config": {"quant_method": "bitsandbytes"}},
                                        "is not DeepSeek's block FP8")])
def test_unsupported_configs_are_one_line(tmp_path: Path, over: dict, what: str, capsys) -> None:
    src = tmp_path / "hf"
    hf_model().save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text()) | over
    (src / "config.json").write_text(json.dumps(cfg))
    assert import_main(["--input", str(src), "--output", str(tmp_path / "c"), "--quiet"]) == 4
    assert what in capsys.readouterr().err
