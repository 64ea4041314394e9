"""Gated DeltaNet as the layer pattern's `linear_attention` mixer (megalite/model/linear_mixer.py), and Kimi Delta
Attention as its `kimi_delta_attention` one: a tiny Qwen3.5-like
hybrid (tests/layer_pattern_utils.py `hybrid_cfg`: 3 linear layers then 1 full-attention layer, sequence 40, not a
multiple of the chunk) trained at tp2 + sp, pp2 (unequal stages), ZeRO 1-3, ep2 (its MoE variant), full recompute,
FP8 (against the single-process FP8 run) and cp in each cp mode (the linear layers by state passing, with and without
packed documents; the 'cp' bytes counted equal to the formulas) against one process (losses, gradient norms, every
parameter after 3 AdamW steps: tests/layer_pattern_ranks.py's check and tolerances), packed documents
equal to each document alone, KV-cached generation with the recurrent state equal to the full forward, the config
checks, the cost the pipeline balances by, Muon leaving the conv kernel to AdamW, and pretrain.py training one.
The layouts, packing and generation tests run a tiny Nemotron-H-like model too (`nemotron_cfg`: Mamba2, MLP and
attention as one-part layers, megalite/model/pattern.py), its pp2 with stages of 2 and 3 layers; the layouts a tiny
Kimi-Linear-like hybrid (`kimi_cfg`: Kimi Delta Attention layers).

Tolerances: tests/test_document_mask.py's (the packed and separate runs sum the same terms in another order, fp32)
and tests/test_layer_pattern.py's for generation (the argmax exactly, the logits to fp32 round-off: the step runs
the recurrence token by token where the forward runs it by chunks, ~1e-6 apart).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from megalite.config.layers import layer_problems
from megalite.config.schema import Config
from megalite.context.costs import cp_attention_bytes, document_ids_bytes
from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.inference.generate import KVCache, SamplingConfig, forward_cached, generate_ids
from megalite.model.gpt import GPT
from megalite.model.linear_mixer import LinearMixer
from megalite.model.pattern import LINEAR_CHUNK, layer_costs, linear_dims
from megalite.optim.muon_plan import takes_muon
from megalite.parallel.param_spec import named_param_specs
from megalite.parallel.state import ParallelState
from megalite.recurrent.chunked import CHUNK
from megalite.recurrent.costs import RecurrentDims, cp_state_passing_bytes
from tests.layer_pattern_ranks import check_layout
from tests.layer_pattern_utils import hybrid_cfg, nemotron_cfg
from tests.test_cp_training import MICRO, M, STEPS
from tests.test_document_mask import EOD, TOL, _losses_and_grads

LINEAR_ARGS = ["linear_attention"] * 3 + ["full_attention"]


LAYOUTS: list[tuple[str, dict]] = [
    ("hybrid", dict(tp=2, sp=True)), ("hybrid", dict(pp=2, pp_layers=[1, 3])),
    *[("hybrid", dict(zero=z)) for z in (1, 2, 3)],
    ("hybrid-moe", dict(ep=2)),
    ("hybrid", dict(tp=2, sp=True, recompute="full")),
    # fp8.min_dim 4 puts in_proj in FP8 too (its gate parts are H = 4 wide); the reference runs the same recipe
    ("hybrid", dict(tp=2, sp=True, fp8="tensorwise", fp8_min_dim=4)),
    ("nemotron", dict(tp=2, sp=True)), ("nemotron", dict(pp=2, pp_layers=[2, 3])), ("nemotron", dict(zero=3)),
    ("kimi", dict(tp=2, sp=True)), ("kimi", dict(pp=2, pp_layers=[1, 3])), ("kimi", dict(zero=3)),
]


@pytest.mark.parametrize("kind,run", LAYOUTS, ids=lambda v: v if isinstance(v, str) else "-".join(
    f"{k}{w}" for k, w in v.items()))
def test_hybrid_layouts_match_one_process(dist_world, kind: str, run: dict) -> None:
    dist_world(2).run(check_layout, kind, run)


CP_RUNS: list[tuple[int, dict]] = [
    (2, dict(cp=2, cp_mode="ring")),
    (2, dict(cp=2, cp_mode="ring", docs=True)),
    (2, dict(cp=2, cp_mode="a2a", docs=True)),
    (2, dict(cp=2, cp_mode="allgather", docs=True, recompute="full")),
    (4, dict(cp=2, cp_mode="ring", tp=2, sp=True, docs=True)),
    (4, dict(cp=4, cp_mode="hybrid", cp_a2a=2, docs=True)),
]


def _cp_bytes(run: dict) -> Fraction:
    """What the counter files under 'cp' over the training steps: per micro-batch, the full layer's cp mode
    (`context.costs`), each linear layer's state passing (`recurrent.costs.cp_state_passing_bytes`), the document
    ids' gather; full recompute runs every forward's share twice."""
    cfg, tp, cp = hybrid_cfg(), run.get("tp", 1), run["cp"]
    d = linear_dims(cfg, cfg.head_dim)
    local = RecurrentDims(d.value_heads // tp, d.key_head_dim, d.value_head_dim, (2 * d.key_dim + d.value_dim) // tp,
                          d.conv_kernel)
    linear = cp_state_passing_bytes(local, MICRO, cp, act_bytes=4)
    full = cp_attention_bytes(ContextOptions.of(run["cp_mode"], a2a_degree=run.get("cp_a2a", 1)), MICRO,
                              cfg.seq_len, cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim, cp, 4)
    again = run.get("recompute") == "full"
    per_micro = sum(n * (c.total + (c.forward if again else 0)) for n, c in ((3, linear), (1, full)))
    ids = document_ids_bytes(MICRO, cfg.seq_len, cp) if run.get("docs") else 0
    return Fraction(STEPS * M * (per_micro + ids))


@pytest.mark.parametrize("world,run", CP_RUNS, ids=lambda v: v if isinstance(v, int) else "-".join(
    f"{k}{w}" for k, w in v.items()))
def test_hybrid_cp_by_state_passing_matches_one_process(dist_world, world: int, run: dict) -> None:
    """Context parallelism in the hybrid model: the linear layers pass states between the zigzag slices, the full
    layer runs the cp mode; losses, gradient norms and every parameter equal one process, with documents crossing
    the slices (the conv and the state reset at each start), and every rank's 'cp' bytes equal the formulas."""
    counted = dist_world(world).run(check_layout, "hybrid", run)
    assert counted == [_cp_bytes(run)] * world


# The two recurrent models: their config, the name part of their recurrent layers' parameters, how many such layers
MODELS = [pytest.param(hybrid_cfg, ".gdn.", 3, id="hybrid"), pytest.param(nemotron_cfg, ".mamba.", 2, id="nemotron")]


@pytest.mark.parametrize("make,part,layers", MODELS)
def test_packed_documents_equal_each_document_alone(make: Callable[..., Any], part: str, layers: int) -> None:
    """Three documents packed in one 40-token sample (lengths 13, 17, 9, each closed by its EOD): per-token losses
    and every gradient equal each document run alone; the conv window and the state restart at each document (the
    unmasked run differs: the test can fail)."""
    cfg = make(vocab_size=61)
    gen = torch.Generator().manual_seed(3)
    docs = [torch.cat([torch.randint(1, cfg.vocab_size, (n - 1,), generator=gen), torch.tensor([EOD])])
            for n in (13, 17, 9)]
    packed = torch.cat(docs + [torch.randint(1, cfg.vocab_size, (1,), generator=gen)])
    masked = GPT(cfg, ParallelState(), seed=5, context=ContextOptions(document_eod=EOD))
    got, got_grads = _losses_and_grads(masked, packed[None, :-1], packed[None, 1:])
    plain = GPT(cfg, ParallelState(), seed=5)
    want: list[torch.Tensor] = []
    want_grads: dict[str, torch.Tensor] = {}
    start = 0
    for doc in docs:
        n = len(doc)
        loss, grads = _losses_and_grads(plain, packed[None, start:start + n], packed[None, start + 1:start + n + 1])
        want.append(loss[0])
        for name, g in grads.items():
            want_grads[name] = want_grads[name] + g if name in want_grads else g
        start += n
    torch.testing.assert_close(got[0], torch.cat(want), atol=TOL, rtol=0)
    assert any(part in n for n in got_grads)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], atol=TOL, rtol=TOL, msg=lambda m: f"{name}: {m}")
    unmasked, _ = _losses_and_grads(plain, packed[None, :-1], packed[None, 1:])
    assert (unmasked[0] - got[0]).abs().max() > 1e-3


@pytest.mark.parametrize("make,part,layers", MODELS)
def test_cached_generation_with_the_recurrent_state_equals_the_full_forward(make: Callable[..., Any], part: str,
                                                                            layers: int) -> None:
    """Greedy decoding (the linear layers carry their conv window and state, the full layer its KV cache) equals
    the full forward's argmax token for token, and the cached logits equal the forward's."""
    model = GPT(make(vocab_size=61), ParallelState(), seed=5).eval()
    with torch.no_grad():  # sharpen the distribution: a random init is near-uniform (ties)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    prompt = [5, 17, 3, 42, 8, 9]
    new = list(generate_ids(model, prompt, SamplingConfig(12), use_cache=True))
    ids = torch.tensor([prompt + new])
    with torch.no_grad():
        full = model(ids)[..., :61]
    assert full[0, len(prompt) - 1:-1].argmax(-1).tolist() == new and len(new) == 12
    cache = KVCache(model, 1, torch.float32)
    got = torch.cat([forward_cached(model, ids[:, :6], cache)] +
                    [forward_cached(model, ids[:, i:i + 1], cache) for i in range(6, ids.shape[1])], dim=1)
    assert sum(c is not None for c in cache.recurrent.values()) == layers
    torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)


def _cfg(**model: object) -> Config:
    cfg = Config()
    cfg.model.num_layers, cfg.model.layer_types = 4, list(LINEAR_ARGS)
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


@pytest.mark.parametrize("model,sets,says", [
    (dict(linear_num_key_heads=2, linear_num_value_heads=3), {}, "must be a multiple of linear_num_key_heads=2"),
    (dict(linear_conv_kernel_dim=0), {}, "linear_conv_kernel_dim=0 must be >= 1"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=6), {"parallel.tp": 2}, "divisible by parallel.tp=2"),
    (dict(seq_len=16), {"parallel.cp": 4}, "zigzag slices of 2 tokens, fewer than the conv window's 3 past inputs"),
    (dict(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
          linear_value_head_dim=128), {"parallel.tp": 2, "fp8.recipe": "blockwise", "fp8.min_dim": 4},
     "attn.gdn.in_proj splits a dimension of 4 into 2-wide shards"),
])
def test_bad_linear_configs_say_what_is_wrong(model: dict, sets: dict, says: str) -> None:
    cfg = _cfg(**model)
    for key, v in sets.items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, v)
    assert any(says in line for line in layer_problems(cfg)), layer_problems(cfg)
    assert not layer_problems(_cfg())


def test_validation_takes_linear_layers_in_every_cp_mode() -> None:
    """A hybrid model at cp > 1 is a valid config in each cp mode (state passing beside the mode: the runs above)."""
    from tests.test_cp_training import problems

    hybrid = ["--model.layer_types", ",".join(LINEAR_ARGS), "--model.num_layers", "4", "--model.seq_len", "32"]
    for mode, world in (("ring", 2), ("allgather", 2), ("a2a", 2), ("hybrid", 4)):
        got = problems(world, *hybrid, "--parallel.cp", str(world), "--parallel.cp_mode", mode, "--parallel.cp_a2a",
                       str(world // 2))
        assert got == "", (mode, got)


def test_linear_layers_cost_their_chunked_form_and_pipeline_balances_by_it() -> None:
    """layer_costs prices a linear layer by its projections and the chunked recurrence (not attention's s^2 term):
    at a long sequence it is the cheaper one, so pp balances more linear layers into a stage."""
    assert LINEAR_CHUNK == CHUNK
    costs = layer_costs(hybrid_cfg(seq_len=4096))
    assert costs[0] == costs[1] == costs[2] < costs[3]
    assert layer_costs(hybrid_cfg(seq_len=8192))[3] - costs[3] > layer_costs(hybrid_cfg(seq_len=8192))[0] - costs[0]


def test_muon_leaves_the_conv_kernel_to_adamw() -> None:
    model = GPT(hybrid_cfg(), ParallelState(), seed=5)
    specs = named_param_specs(model, ConfigError)
    params = dict(model.named_parameters())
    assert not takes_muon(params["layers.0.attn.gdn.conv_weight"], specs["layers.0.attn.gdn.conv_weight"])
    assert takes_muon(params["layers.0.attn.gdn.in_proj.weight"], specs["layers.0.attn.gdn.in_proj.weight"])
    assert isinstance(model.layers["0"].attn, LinearMixer)


def test_pretrain_trains_a_hybrid_model(demo_cache_dir: str, tmp_path: Path) -> None:
    from pretrain import main
    from tests.test_pretrain import _args, _losses

    assert main(_args(demo_cache_dir, tmp_path, "--model.layer_types", ",".join(LINEAR_ARGS), "--model.num_layers",
                      "4", "--train.steps", "3")) == 0
    losses = _losses(tmp_path)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert "linear_attention" in (tmp_path / "config.toml").read_text()
