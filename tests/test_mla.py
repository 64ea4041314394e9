"""MLA and RoPE scaling against transformers: YaRN / llama3 frequencies and factors equal ROPE_INIT_FUNCTIONS',
one MLA layer (YaRN on) equals DeepseekV3Attention with the weights copied through megalite/checkpoint/interop/hf_mla.py,
both ways, interleaved RoPE or not, with and without the low-rank query; and the `[mla]` checks."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megalite.checkpoint.interop.hf_mla import attention_from_hf, attention_to_hf
from megalite.config.schema import ModelConfig
from megalite.mla.attention import MLAContext, MLAttention
from megalite.mla.config import MLAConfig, mla_problems
from megalite.model.ops import TORCH_OPS, masked_attention
from megalite.model.rope import RopeScaling, attention_factor, inv_freq, rope_tables, softmax_scale_factor
from megalite.parallel.state import ParallelState

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale  # noqa: E402

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
            mscale=0.707, mscale_all_dim=1.0)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)


def _ours(p: dict) -> RopeScaling:
    return RopeScaling(p["rope_type"], p["factor"], p["original_max_position_embeddings"], p.get("beta_fast", 32.0),
                       p.get("beta_slow", 1.0), p.get("mscale", 0.0), p.get("mscale_all_dim", 0.0),
                       p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0))


@pytest.mark.parametrize("params,dim", [(YARN, 16), (YARN | dict(mscale=0.0, mscale_all_dim=0.0), 64),
                                        (YARN | dict(beta_fast=8.0, beta_slow=2.0), 32), (LLAMA3, 32)])
def test_rope_scaling_equals_transformers(params: dict, dim: int) -> None:
    hf = transformers.LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim,
                                  max_position_embeddings=256,
                                  rope_parameters={"rope_theta": 10000.0, **params})
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    r = _ours(params)
    # Same fp32 formulas in the same order: equal to the last bit.
    assert torch.equal(inv_freq(dim, 10000.0, r), want)
    assert attention_factor(r) == pytest.approx(want_factor, rel=1e-12)
    assert softmax_scale_factor(r) == pytest.approx(yarn_apply_mscale(params, 1.0), rel=1e-12)
    cos, _ = rope_tables(8, dim, 10000.0, r)
    assert torch.allclose(cos[3], (3 * want.double()).cos().float() * want_factor, atol=1e-6)


def _hf_attention(q_lora: int | None, interleave: bool) -> tuple:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                        q_lora_rank=q_lora, kv_lora_rank=16, qk_rope_head_dim=8,
                                        qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=128,
                                        rope_interleave=interleave, rms_norm_eps=1e-6,
                                        rope_parameters={"rope_theta": 10000.0, **YARN})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():  # norms off 1, so a wrong norm mapping shows
        for name, p in attn.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if p.dim() > 1 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    return cfg, attn, DeepseekV3RotaryEmbedding(cfg)


def _megalite_attention(q_lora: int, params: dict) -> MLAttention:
    mla = MLAConfig(kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
    shape = SimpleNamespace(hidden_size=64, num_heads=4, num_layers=2, norm_eps=1e-6, init_std=0.02,
                            recompute="none")
    ctx = MLAContext(mla, softmax_scale_factor(_ours(params)), TORCH_OPS, masked_attention)
    return MLAttention(shape, ctx, ParallelState(), TORCH_OPS, "layers.0.attn", seed=1)


@pytest.mark.parametrize("q_lora,interleave", [(32, True), (None, False)])
def test_mla_layer_equals_deepseek_v3_attention(q_lora: int | None, interleave: bool) -> None:
    cfg, hf, rotary = _hf_attention(q_lora, interleave)
    ours = _megalite_attention(q_lora or 0, YARN)
    mla = ours.mla.config
    got = attention_from_hf(hf.state_dict(), mla, 4, interleave)
    assert sorted(got) == sorted(n for n, _ in ours.named_parameters())
    ours.load_state_dict(got)
    # Export is the exact inverse (a permutation and renames).
    back = attention_to_hf(got, mla, 4, interleave)
    assert sorted(back) == sorted(hf.state_dict()) and all(torch.equal(back[k], v) for k, v in hf.state_dict().items())

    s = 12
    x = torch.randn(2, s, 64, requires_grad=True)
    cos, sin = rope_tables(s, 8, 10000.0, _ours(YARN))
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    pos = torch.arange(s)[None].expand(2, s)
    y_ours = ours(x, cos, sin)
    y_hf, _ = hf(x, rotary(x, pos), mask)
    # fp32, same weights; SDPA vs eager matmul+softmax and a different order of the rope products: a few ulps
    # of O(1) outputs. A wrong mapping (a rope permutation, a swapped norm, the scale) is O(0.1).
    assert torch.allclose(y_ours, y_hf, atol=2e-5, rtol=0), (y_ours - y_hf).abs().max()
    g = torch.randn_like(y_hf)
    (dx_ours,) = torch.autograd.grad(y_ours, x, g)
    (dx_hf,) = torch.autograd.grad(y_hf, x, g)
    assert torch.allclose(dx_ours, dx_hf, atol=2e-5, rtol=0)


def test_mla_problems() -> None:
    model = ModelConfig(num_heads=4, num_kv_heads=4)
    assert mla_problems(MLAConfig(), model) == []  # off
    assert mla_problems(MLAConfig(kv_lora_rank=16, qk_rope_head_dim=8), model) == []
    assert "even" in " ".join(mla_problems(MLAConfig(kv_lora_rank=16, qk_rope_head_dim=7), model))
    assert "num_kv_heads" in " ".join(mla_problems(MLAConfig(kv_lora_rank=16),
                                                   ModelConfig(num_heads=4, num_kv_heads=2)))
    assert "arch=llama" in " ".join(mla_problems(MLAConfig(kv_lora_rank=16), ModelConfig(arch="gpt2")))
    assert "kv_lora_rank = 0" in " ".join(mla_problems(MLAConfig(q_lora_rank=8), model))


def test_mla_costs_by_hand() -> None:
    """The tiny shape by hand: h 64, H 4, r_q 32, r_kv 16, d_n 16, d_r 8 (d 24), d_v 12, 2 layers."""
    from megalite.mla import costs
    from megalite.model.gpt import GPT, count_parameters
    from megalite.model.params import ParamShape, count_params
    from tests.parallel_utils import tiny_model_cfg, with_sections

    m = MLAConfig(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
    # q_b 32x96, kv_b 16x(4x28), out 48x64; q_a 64x32, kv_a 64x(16+8); norms 32 + 16.
    assert costs.attention_weights(64, 4, m) == (32 * 96 + 16 * 112 + 48 * 64, 64 * 32 + 64 * 24)
    assert costs.attention_params(64, 4, m) == 3072 + 1792 + 3072 + 2048 + 1536 + 48
    # The compressed cache: (16 + 8) per layer, against 4 x (24 + 12) expanded; 2-byte elements.
    assert costs.kv_cache_bytes_per_token(2, m, 2) == 2 * 24 * 2
    assert costs.expanded_kv_cache_bytes_per_token(2, 4, m, 2) == 2 * 4 * 36 * 2
    # Attention core per token at s 16: QK^T 2·16·4·24, AV 2·16·4·12; executed at width 24 for both.
    assert costs.core_flops_per_token(16, 4, m) == (2 * 16 * 4 * 36, 4 * 16 * 4 * 24)
    # Activations, s 16, b 2, 16-bit, no parallelism: dense 26·sbh + latents sb(4·32 + 2·24 + 2·16)
    # + heads sb·4·(6·24 + 2·12) + scores 5·4·16·16·2.
    sb = 16 * 2
    want = 26 * sb * 64 + sb * (128 + 48 + 32) + sb * 4 * (144 + 24) + 5 * 4 * 16 * 16 * 2
    assert costs.activation_bytes_per_layer(16 * 2, 64, 4, m, kv_len=16) == want
    for q_lora in (32, 0):  # the formula equals the built model's count, with and without the low-rank query
        mla = MLAConfig(kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
        cfg = tiny_model_cfg(hidden_size=64, num_heads=4, num_kv_heads=4, make_vocab_divisible_by=1)
        built = count_parameters(GPT(with_sections(cfg, mla=mla), ParallelState(), seed=0), ParallelState())
        assert built == count_params(ParamShape("llama", 2, 64, 4, 4, 64, 61, 8, False, mla=mla))


def test_estimator_prices_mla() -> None:
    """The estimator's parameters, stage split and FLOPs use MLA's when `ModelDims.mla` is set."""
    from megalite.mla.costs import MLADims, attention_params
    from megalite.perfmodel.estimate import ModelDims, dims_params, stage_params
    from megalite.perfmodel.flops import flops_per_token

    m = MLADims(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
    plain = ModelDims(2, 64, 4, 61, 16, "llama", 4, 64, False)
    dims = ModelDims(2, 64, 4, 61, 16, "llama", 4, 64, False, mla=m)
    gqa_attn = 4 * 64 * 64
    assert dims_params(dims) - dims_params(plain) == 2 * (attention_params(64, 4, m) - gqa_attn)
    one, two = stage_params(dims, 1, 1, 0), stage_params(dims, 2, 1, 0)
    # tp 2 halves q_b, kv_b, out and the MLP; q_a, kv_a, the norms stay whole.
    split, whole = 32 * 96 + 16 * 112 + 48 * 64, 64 * 32 + 64 * 24
    assert one.layers - two.layers == 2 * (split + 3 * 64 * 64) // 2
    assert two.layers == 2 * ((split + 3 * 64 * 64) // 2 + whole + 48 + 2 * 64)
    model, hardware = flops_per_token(dims, dims_params(dims), "none")
    assert model == 6.0 * dims_params(dims) + 6.0 * 2 * 16 * 4 * 36  # 3 x the forward core, 2 layers
    weights = 2 * (split + whole + 3 * 64 * 64) + 61 * 64
    assert hardware == 6.0 * weights + 3.0 * 2 * 4 * 16 * 4 * 24


def test_mla_under_fp8() -> None:
    """fp8.recipe: q_b / q, kv_b and out (the parallel linears) run in FP8, q_a and kv_a (replicated, partial
    gradients) stay in the run dtype; a training step's loss stays within FP8's error of the fp32 one (e4m3's
    2^-4 relative steps through a few GEMMs: ~1e-2 on a loss of ~4; a broken FP8 path is O(1) or NaN)."""
    from megalite.fp8.enable import Fp8Settings, enable_fp8
    from megalite.model.gpt import GPT
    from megalite.training.step import train_step
    from tests.parallel_utils import reference_optimizer, step_context, tiny_model_cfg, tiny_train_cfg, with_sections

    cfg = tiny_model_cfg(hidden_size=64, num_heads=4, num_kv_heads=4, num_layers=1, seq_len=8)
    d = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    losses = []
    for recipe in (None, "tensorwise"):
        st = ParallelState()
        model = GPT(with_sections(cfg, mla=MLAConfig(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                                    qk_nope_head_dim=16, v_head_dim=12)), st, seed=2)
        if recipe is not None:
            names = enable_fp8([model], Fp8Settings(recipe, 8), st)
            assert sorted(n for n in names if ".attn." in n) == ["layers.0.attn.kv_b", "layers.0.attn.out",
                                                                 "layers.0.attn.q_b"]
        losses.append(train_step(step_context(model, st, torch.float32, tiny_train_cfg(1)),
                                 reference_optimizer(model, st), [(d[:, :-1], d[:, 1:])], 0).loss)
    assert abs(losses[0] - losses[1]) < 5e-2, losses


def test_estimate_tool_reads_the_mla_section(tmp_path, capsys) -> None:
    """tools/estimate.py --config with an [mla] section prices MLA (its parameter count) and reports the cache."""
    from megalite.model.params import ParamShape, count_params
    from tools.estimate import main as estimate_main

    (tmp_path / "c.toml").write_text("[model]\nnum_kv_heads = 4\nvocab_size = 256\n[train]\ndtype = \"fp32\"\n[mla]\nkv_lora_rank = 32\n"
                                     "q_lora_rank = 64\nqk_rope_head_dim = 16\nqk_nope_head_dim = 32\nv_head_dim = 32\n")
    assert estimate_main(["--config", str(tmp_path / "c.toml"), "--json"]) == 0
    import json

    got = json.loads(capsys.readouterr().out)
    mla = MLAConfig(kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    m = ModelConfig()
    assert got["params"] == count_params(ParamShape("llama", m.num_layers, 128, 4, 4, 384, 256, 128, False, mla=mla))
    assert estimate_main(["--config", str(tmp_path / "c.toml")]) == 0
    assert "MLA KV cache for generation: 0.75 KiB per token" in capsys.readouterr().out  # 4 layers x 48 x 4 bytes


def test_estimate_and_plan_take_mla_flags(capsys) -> None:
    """--kv-lora-rank (and the other widths) price MLA in tools/estimate.py and tools/plan.py."""
    import json

    from megalite.mla.costs import MLADims
    from megalite.perfmodel.estimate import PRESETS, dims_params
    from tools.estimate import main as estimate_main
    from tools.plan import main as plan_main

    flags = ["--kv-lora-rank", "16", "--q-lora-rank", "32", "--qk-rope-head-dim", "8", "--qk-nope-head-dim", "16",
             "--v-head-dim", "12"]
    assert estimate_main(["--preset", "llama-7b", *flags, "--json"]) == 0
    mla = MLADims(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
    want = dims_params(replace(PRESETS["llama-7b"], mla=mla))
    assert json.loads(capsys.readouterr().out)["params"] == want
    assert plan_main(["--preset", "llama-7b", *flags, "--global-batch-size", "8", "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == want
    assert estimate_main(["--preset", "llama-7b", "--kv-lora-rank", "16", "--v-head-dim", "0"]) != 0


def test_dense_deepseek_v3_logits(tmp_path) -> None:
    """A whole DeepseekV3ForCausalLM with dense MLPs only (first_k_dense_replace = every layer: the MoE router is
    the "mtp" engineer's) and YaRN: megalite's GPT with MLA computes its logits from the same weights. The attention
    by checkpoint/interop/hf_mla.py, the rest by Llama's names (the whole conversion: tests/test_hf_deepseek.py)."""
    from megalite.model.gpt import GPT
    from tests.parallel_utils import tiny_model_cfg, with_sections

    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=67, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, first_k_dense_replace=2, max_position_embeddings=32, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, **YARN, "original_max_position_embeddings": 8},
        tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # norms off 1
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape))
    mla = MLAConfig(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
    cfg = tiny_model_cfg(vocab_size=67, hidden_size=64, ffn_hidden_size=96, num_heads=4, num_kv_heads=4, seq_len=32,
                         make_vocab_divisible_by=1, norm_eps=1e-6, rope_scaling="yarn", rope_factor=4.0,
                         rope_original_max_positions=8, rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=0.707,
                         rope_mscale_all_dim=1.0)
    ours = GPT(with_sections(cfg, mla=mla), ParallelState(), seed=0).eval()
    sd = hf.state_dict()
    mine = {"embedding.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"],
            "head.weight": sd["lm_head.weight"]}
    for i in range(2):
        hf_layer = f"model.layers.{i}."
        attn = {k[len(hf_layer + "self_attn."):]: v for k, v in sd.items() if k.startswith(hf_layer + "self_attn.")}
        mine |= {f"layers.{i}.attn.{k}": v for k, v in attention_from_hf(attn, mla, 4, True).items()}
        mine |= {f"layers.{i}.norm1.weight": sd[hf_layer + "input_layernorm.weight"],
                 f"layers.{i}.norm2.weight": sd[hf_layer + "post_attention_layernorm.weight"],
                 f"layers.{i}.mlp.up.weight": torch.cat([sd[hf_layer + "mlp.gate_proj.weight"],
                                                         sd[hf_layer + "mlp.up_proj.weight"]]),
                 f"layers.{i}.mlp.down.weight": sd[hf_layer + "mlp.down_proj.weight"]}
    ours.load_state_dict(mine)
    ids = torch.randint(0, 67, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = (ours(ids) - hf(ids).logits).abs().max().item()
    assert err <= 1e-5, f"megalite's logits differ from transformers' DeepseekV3 by {err:.2e}"  # as test_hf.py
