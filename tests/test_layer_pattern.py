"""The layer pattern and the model-side attention / MLP variants on one process (megalite/model/pattern.py,
docs/attention.md): each piece against an independent oracle (transformers' own functions where they exist),
windows that bite, recompute and generation that change nothing, document masking equal to each document alone,
and the config's checks. The layouts: tests/test_layer_pattern_parallel.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megalite.config import Config, resolve, validate
from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.inference.generate import KVCache, SamplingConfig, forward_cached, generate_ids
from megalite.layers.activation import MLPActivation
from megalite.model.gpt import GPT
from megalite.model.ops import TORCH_OPS
from megalite.model.pattern import FULL, SLIDING, LayerSpec, layer_specs, variant_info
from megalite.parallel.state import ParallelState
from tests.layer_pattern_utils import gated_cfg, gemma3_cfg, gpt_oss_cfg, perturb
from tests.parallel_utils import tiny_model_cfg

VOCAB = 61
CONFIGS = {"gpt-oss": gpt_oss_cfg, "gemma3": gemma3_cfg, "gated": gated_cfg}


def _model(kind: str, **overrides: object) -> GPT:
    st = ParallelState()
    model = GPT(CONFIGS[kind](vocab_size=VOCAB, **overrides), st, seed=3)
    perturb(model, st)
    return model


def _attn(model: GPT, layer: str) -> Any:
    return model.layers[layer].attn


def test_the_pattern_resolves_per_layer() -> None:
    specs = layer_specs(gemma3_cfg(num_layers=8))
    assert [s.mixer for s in specs] == [SLIDING] * 5 + [FULL] + [SLIDING] * 2  # a period, repeated
    assert [s.window for s in specs[4:7]] == [4, None, 4]
    assert [s.rope_theta for s in specs[4:7]] == [10000.0, 1e6, 10000.0]
    gated = layer_specs(gated_cfg())
    assert [s.rotary_dim(8) for s in gated] == [2, 0]  # a quarter of 8 dims; layer 1 is NoPE
    assert layer_specs(gpt_oss_cfg(layer_types=[], sliding_window=0)) == (LayerSpec(rope_theta=150000.0),) * 4


def test_clamped_swiglu_is_gpt_oss() -> None:
    """gpt-oss's gate: transformers' GptOssExperts._apply_gate on its interleaved [gate, up] columns."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from types import SimpleNamespace

    hf = gpt_oss.GptOssExperts(SimpleNamespace(intermediate_size=8, num_local_experts=1, hidden_size=4,
                                               swiglu_alpha=1.702, swiglu_limit=7.0))
    gate, up = torch.randn(2, 8) * 6, torch.randn(2, 8) * 6  # beyond the limit on both sides
    interleaved = torch.stack([gate, up], dim=-1).flatten(-2)
    want = hf._apply_gate(interleaved)
    got = MLPActivation("clamped_swiglu", 1.702, 7.0)(TORCH_OPS, [gate, up])
    assert torch.equal(got, want)


def test_geglu_is_gemma() -> None:
    act = pytest.importorskip("transformers.activations").ACT2FN["gelu_pytorch_tanh"]
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    assert torch.allclose(MLPActivation("geglu")(TORCH_OPS, [gate, up]), act(gate) * up, atol=1e-7)


def test_partial_rope_is_transformers() -> None:
    """RoPE on the first quarter of each head, the rest passed: transformers' partial-rotary apply (Qwen3-Next),
    its tables built for the rotated dims only."""
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    model = _model("gated")
    attn = _attn(model, "0")
    x = torch.randn(1, 16, 32)
    cos, sin = model.rope_of("0")
    q, k, _, gate = attn.project(x, cos, sin)
    q0, k0 = attn.qkv(x)[0].view(1, 16, -1, 8), attn.qkv(x)[1].view(1, 16, -1, 8)
    hf_cos, hf_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # [1, S, 2] for 2 dims
    want_q, want_k = qn.apply_rotary_pos_emb(q0, k0, hf_cos, hf_sin, unsqueeze_dim=2)
    assert torch.allclose(q, want_q, atol=1e-6) and torch.allclose(k, want_k, atol=1e-6)
    assert gate is not None and gate.shape == (1, 16, 8 * 8)
    nope = _attn(model, "1")
    q1, _, _, _ = nope.project(x, *model.rope_of("1"))
    assert torch.equal(q1, nope.qkv(x)[0].view(1, 16, -1, 8))  # NoPE: not rotated at all


def test_output_gate_multiplies_each_element() -> None:
    model = _model("gated", attn_output_gate="head")
    attn = _attn(model, "0")
    x = torch.randn(2, 16, 32)
    o = torch.randn(2, 16, 8, 8)
    _, _, _, gate = attn.project(x, *model.rope_of("0"))
    assert gate is not None and gate.shape == (2, 16, 8)  # one gate per head
    want = attn.out((o * torch.sigmoid(gate)[..., None]).reshape(2, 16, 64))
    assert torch.allclose(attn.finish(o, gate), want, atol=1e-6)


def test_a_window_bounds_what_a_position_sees() -> None:
    """One sliding layer of W = 4: position i's logits do not move when a token before i - 3 changes, and do
    when one inside the window does (the full model, embedding to head)."""
    model = _model("gemma3", num_layers=1, layer_types=["sliding_attention"], rope_theta=10000.0,
                   rope_local_theta=0.0)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids)
        far, near = ids.clone(), ids.clone()
        far[0, 5] = (ids[0, 5] + 1) % VOCAB   # outside position 9's window (6..9)
        near[0, 6] = (ids[0, 6] + 1) % VOCAB  # inside it
        assert torch.equal(model(far)[0, 9], base[0, 9])
        assert not torch.allclose(model(near)[0, 9], base[0, 9])


def test_final_softcap_bounds_the_logits() -> None:
    model = _model("gemma3", final_softcap=0.1)
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        assert model(ids).abs().max() <= 0.1
        uncapped = GPT(gemma3_cfg(vocab_size=VOCAB, final_softcap=0.0), ParallelState(), seed=3)
        uncapped.load_state_dict(model.state_dict())
        assert torch.allclose(model(ids), 0.1 * torch.tanh(uncapped(ids) / 0.1), atol=1e-6)


@pytest.mark.parametrize("kind", ["gpt-oss", "gemma3"])
def test_recompute_is_exact(kind: str) -> None:
    """Selective and full recompute rerun the same kernels on the same inputs: loss and gradients bitwise."""
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    out = {}
    for mode in ("none", "selective", "full"):
        model = _model(kind, recompute=mode)
        loss = model(ids[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        out[mode] = (loss.detach(), {n: torch.clone(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    for mode in ("selective", "full"):
        assert torch.equal(out[mode][0], out["none"][0]), mode
        assert all(torch.equal(g, out["none"][1][n]) for n, g in out[mode][1].items()), mode


@pytest.mark.parametrize("kind", ["gpt-oss", "gemma3", "gated"])
def test_document_masking_equals_each_document_alone(kind: str) -> None:
    """A packed row of three documents under data.document_mask: each document's per-token losses equal the
    same model's on that document alone (positions restart, windows and sinks per document)."""
    eod = 0
    model = _model(kind)
    masked = GPT(CONFIGS[kind](vocab_size=VOCAB), ParallelState(), seed=3, context=ContextOptions.of("ring", eod))
    masked.load_state_dict(model.state_dict())
    ids = torch.randint(1, VOCAB, (1, 17), generator=torch.Generator().manual_seed(4))
    ids[0, 4] = ids[0, 11] = eod  # documents [0, 5), [5, 12), [12, 16]
    with torch.no_grad():
        packed = masked(ids[:, :-1], ids[:, 1:])
        for lo, hi in ((0, 5), (5, 12), (12, 16)):
            alone = model(ids[:, lo:hi], ids[:, lo + 1:hi + 1])
            assert torch.allclose(packed[:, lo:hi], alone, atol=1e-5), (lo, hi)


@pytest.mark.parametrize("kind", ["gpt-oss", "gemma3", "gated"])
def test_kv_cached_generation_equals_the_full_forward(kind: str) -> None:
    """Greedy decoding with the per-layer cache (a sliding layer keeps W - 1 positions) equals the argmax of the
    ordinary forward, token for token, and the cached logits equal the forward's (fp32 round-off)."""
    model = _model(kind).eval()
    with torch.no_grad():  # sharpen the distribution: a random init is near-uniform (ties)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    prompt = [5, 17, 3, 42, 8, 9]
    cached = list(generate_ids(model, prompt, SamplingConfig(10), use_cache=True))
    ids = torch.tensor([prompt + cached])
    with torch.no_grad():  # each new token is the full forward's argmax at the position before it
        assert model(ids)[0, len(prompt) - 1:-1, :VOCAB].argmax(-1).tolist() == cached and len(cached) == 10
    cache = KVCache(model, 1, torch.float32)
    got = torch.cat([forward_cached(model, ids[:, :6], cache)] +
                    [forward_cached(model, ids[:, i:i + 1], cache) for i in range(6, ids.shape[1])], dim=1)
    windows = [_attn(model, n).window for n in model.layers]
    assert all(cache.k[n].shape[1] == (w - 1 if w else model.cfg.seq_len) for n, w in zip(model.layers, windows))
    with torch.no_grad():
        want = model(ids)[..., :VOCAB]
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _problems(**model: object) -> str:
    cfg = Config()
    for k, v in model.items():
        setattr(cfg.model, k, v)
    with pytest.raises(ConfigError) as e:
        validate(resolve(cfg, 1), 1)
    return str(e.value)


@pytest.mark.parametrize("fields,text", [
    (dict(layer_types=["sliding_attention"]), "need a window W >= 1"),
    (dict(layer_types=["hyena"]), "is not a mixer"),
    (dict(layer_types=["full_attention"] * 5), "has 5 entries for model.num_layers=4"),
    (dict(sliding_window=4), "no layer is sliding_attention"),
    (dict(rope_fraction=1.5), "must be in [0, 1]"),
    (dict(rope_fraction=0.3), "make it even"),  # int(32 x 0.3) = 9 dims
    (dict(nope_layers=[4]), "each must be a layer index in [0, 4)"),
    (dict(attn_softcap=-1.0), "model.attn_softcap=-1.0 must be > 0"),
    (dict(attn_output_gate="row"), "expected one of none, head, element"),
    (dict(mlp="relu"), "model.mlp='relu'"),
    (dict(mlp="clamped_swiglu", swiglu_limit=0.0), "must be > 0"),
])
def test_bad_fields_are_refused_in_one_line(fields: dict, text: str) -> None:
    assert text in _problems(**fields)


def test_old_configs_build_todays_model() -> None:
    """Every new field at its default is the model of before: plain attention, no extra parameter or table."""
    model = GPT(tiny_model_cfg(vocab_size=VOCAB), ParallelState(), seed=3)
    assert all(_attn(model, n).variant().is_plain for n in model.layers) and not model.rope_keys
    names = {n.removeprefix("layers.0.") for n, _ in model.named_parameters() if n.startswith("layers.0.")}
    assert names == {"norm1.weight", "attn.qkv.weight", "attn.out.weight", "norm2.weight", "mlp.up.weight",
                     "mlp.down.weight"}


@pytest.mark.parametrize("kind", ["gpt-oss", "gemma3", "gated"])
def test_the_parameter_count_is_the_built_models(kind: str) -> None:
    """`count_model_params` (config validation's size check, the estimator) counts every variant's parameters."""
    from megalite.model.params import count_model_params

    cfg = CONFIGS[kind](vocab_size=VOCAB, make_vocab_divisible_by=1)
    built = sum(p.numel() for p in GPT(cfg, ParallelState(), seed=3).parameters())
    assert count_model_params(cfg) == built


@pytest.mark.parametrize("kind", ["gpt-oss", "gemma3", "gated"])
def test_a_checkpoint_records_the_pattern_and_reshards(tmp_path, kind: str) -> None:
    """index.json records every non-default variant field, so the loader builds the same model (equal logits);
    and the offline resharder's layouts (`layout_for`, no model) are the built model's, sinks and gate included."""
    from megalite.checkpoint.layout import layout_for, layout_of, model_info
    from megalite.checkpoint.offline import reshard
    from megalite.checkpoint.sharded import save_sharded
    from megalite.errors import ConfigError
    from megalite.inference.load import load_model
    from megalite.parallel.param_spec import named_param_specs

    model = _model(kind).eval()
    info = model_info(model.cfg)
    recorded = variant_info(model.cfg)
    assert recorded and all(info[k] == v for k, v in recorded.items())
    specs = named_param_specs(model, ConfigError)
    assert {n: layout_for(n, info) for n in specs} == {n: layout_of(n, s.layout) for n, s in specs.items()}
    src = save_sharded(tmp_path / "a", 1, model, None, {}, ParallelState(), keep=0)
    back = reshard(reshard(src, tmp_path / "b", tp=2, show_progress=False), tmp_path / "c", show_progress=False)
    loaded, _ = load_model(back)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(loaded(ids)[..., :VOCAB], model(ids)[..., :VOCAB])  # padded columns: not saved


def test_a_bad_recorded_field_is_refused() -> None:
    from megalite.checkpoint.index_check import model_info_problems
    from megalite.checkpoint.layout import model_info

    info = model_info(gemma3_cfg(vocab_size=VOCAB))
    assert model_info_problems(info) == []
    assert "is not a mixer" in model_info_problems({**info, "layer_types": ["hyena"]})[0]
    assert "model.sliding_window" in model_info_problems({**info, "sliding_window": "wide"})[0]


@pytest.mark.parametrize("preset,params", [("gpt-oss-20b", 20_914_757_184), ("gemma3-1b", 999_885_952)])
def test_the_real_presets_have_the_published_parameter_counts(preset: str, params: int) -> None:
    """The presets' shapes, counted by `count_model_params` (held to built models above), are the released models':
    transformers' GptOssForCausalLM (openai/gpt-oss-20b) and Gemma3ForCausalLM (google/gemma-3-1b-pt) counts."""
    from megalite.config import ModelArgs, parse_args
    from megalite.model.params import count_model_params

    cfg = resolve(parse_args(["--model.preset", preset]), 1)
    assert count_model_params(ModelArgs.from_config(cfg)) == params


def test_yarn_without_truncation_is_gpt_oss() -> None:
    """model.rope_truncate=false: YaRN's ramp between unrounded dims, as gpt-oss releases it (transformers'
    `truncate`); the tables equal transformers' GptOssRotaryEmbedding's."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    from megalite.model.rope import RopeScaling, inv_freq

    hf = GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=256, num_hidden_layers=2,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    want = gpt_oss.GptOssRotaryEmbedding(hf).inv_freq
    scaling = RopeScaling("yarn", 32.0, 4096, 32.0, 1.0, truncate=False)
    assert torch.allclose(inv_freq(64, 150000.0, scaling), want, rtol=1e-6)
    assert not torch.allclose(inv_freq(64, 150000.0, RopeScaling("yarn", 32.0, 4096, 32.0, 1.0)), want, rtol=1e-6)


def test_the_moe_is_gpt_oss_mlp() -> None:
    """A MoE layer of the gpt-oss-like config (biased mixtral router, clamped-SwiGLU experts with biases) equals
    transformers' GptOssMLP holding the same weights (its gate_up_proj interleaves gate and up columns)."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    model = _model("gpt-oss")
    moe: Any = model.layers["1"].mlp
    hf = gpt_oss.GptOssMLP(GptOssConfig(hidden_size=32, intermediate_size=32, num_local_experts=4,
                                        num_experts_per_tok=2, swiglu_limit=0.3))
    up, down = moe.experts.up.detach(), moe.experts.down.detach()  # [E, 2F, H] gate rows then up rows; [E, H, F]
    with torch.no_grad():
        hf.router.weight.copy_(moe.router.weight)
        hf.router.bias.copy_(moe.router.logit_bias)
        gate_up = torch.stack([up[:, :32], up[:, 32:]], dim=2).flatten(1, 2)  # rows gate0, up0, gate1, up1, ...
        hf.experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
        b = moe.experts.up_bias.detach()
        hf.experts.gate_up_proj_bias.copy_(torch.stack([b[:, :32], b[:, 32:]], dim=2).flatten(1))
        hf.experts.down_proj.copy_(down.transpose(1, 2))
        hf.experts.down_proj_bias.copy_(moe.experts.down_bias)
        x = torch.randn(2, 16, 32)
        assert torch.allclose(moe.eval()(x), hf(x)[0], atol=1e-6)


def test_the_gemma3_like_model_is_transformers_gemma3() -> None:
    """The tiny Gemma 3-like model's logits equal transformers' Gemma3ForCausalLM holding its weights: the pattern's
    windows and per-kind RoPE bases, q/k and sandwich norms (Gemma's norms store weight - 1), GeGLU, the embedding
    scale, query_pre_attn_scalar and the final soft-cap. transformers' Gemma 3 takes attn_logit_softcapping in its
    config but never applies it (Gemma 2 does), so the attention soft-cap is off here. (Import / export proper:
    tools/import_hf.py.)"""
    transformers = pytest.importorskip("transformers")

    model = _model("gemma3", attn_softcap=0.0).eval()
    cfg = model.cfg
    hf_cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, sliding_window=4,
        layer_types=list(cfg.layer_types), query_pre_attn_scalar=10,
        final_logit_softcapping=2.0, tie_word_embeddings=True, max_position_embeddings=16,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    hf_cfg._attn_implementation = "eager"
    hf = transformers.Gemma3ForCausalLM(hf_cfg).eval()
    ours = dict(model.named_parameters())
    q, kv = 4 * 16, 2 * 16
    names = {"input_layernorm": "norm1", "post_attention_layernorm": "post_attn_norm",
             "pre_feedforward_layernorm": "norm2", "post_feedforward_layernorm": "post_mlp_norm",
             "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            parts = name.removeprefix("model.").split(".")
            if parts[0] == "embed_tokens":
                p.copy_(ours["embedding.weight"][:VOCAB])
            elif parts[0] == "norm":
                p.copy_(ours["final_norm.weight"] - 1)
            elif parts[0] == "layers":
                i, rest = parts[1], ".".join(parts[2:-1])
                qkv, up = ours[f"layers.{i}.attn.qkv.weight"], ours[f"layers.{i}.mlp.up.weight"]
                f = up.shape[0] // 2
                value = {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q:q + kv],
                         "self_attn.v_proj": qkv[q + kv:], "self_attn.o_proj": ours[f"layers.{i}.attn.out.weight"],
                         "mlp.gate_proj": up[:f], "mlp.up_proj": up[f:],
                         "mlp.down_proj": ours[f"layers.{i}.mlp.down.weight"]}.get(rest)
                p.copy_(value if value is not None else ours[f"layers.{i}.{names[rest]}.weight"] - 1)
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(8))
        want = hf(ids).logits
        assert torch.allclose(model(ids)[..., :VOCAB], want, atol=2e-5), (model(ids)[..., :VOCAB] - want).abs().max()
