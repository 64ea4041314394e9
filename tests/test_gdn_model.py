"""Gated DeltaNet as the layer pattern's `linear_attention` mixer (megalite/model/linear_mixer.py), and Kimi Delta
Attention as its `kimi_delta_attention` one: a tiny Qwen3.5-like
hybrid (tests/layer_pattern_utils.py `hybrid_cfg`: 3 linear layers then 1 full-attention layer, sequence 40, not a
multiple of the chunk) trained at tp2 + sp, pp2 (unequal stages) and ZeRO-3 against one process (losses, gradient
norms, every parameter after 3 AdamW steps: tests/layer_pattern_ranks.py's check and tolerances), packed documents
equal to each document alone, KV-cached generation with the recurrent state equal to the full forward, the config
checks, the cost the pipeline balances by (the layouts also for a tiny Kimi-Linear-like hybrid,
layer_pattern_utils.py `kimi_cfg`), Muon leaving the conv kernel to AdamW, and pretrain.py training one.

Tolerances: tests/test_document_mask.py's (the packed and separate runs sum the same terms in another order, fp32)
and tests/test_layer_pattern.py's for generation (the argmax exactly, the logits to fp32 round-off: the step runs
the recurrence token by token where the forward runs it by chunks, ~1e-6 apart).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.config.layers import layer_problems
from megalite.config.schema import Config
from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.inference.generate import KVCache, SamplingConfig, forward_cached, generate_ids
from megalite.model.gpt import GPT
from megalite.model.linear_mixer import LinearMixer
from megalite.model.pattern import LINEAR_CHUNK, layer_costs
from megalite.optim.muon_plan import takes_muon
from megalite.parallel.param_spec import named_param_specs
from megalite.parallel.state import ParallelState
from megalite.recurrent.chunked import CHUNK
from tests.layer_pattern_ranks import check_layout
from tests.layer_pattern_utils import hybrid_cfg
from tests.test_document_mask import EOD, TOL, _losses_and_grads

LINEAR_ARGS = ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("run", [dict(tp=2, sp=True), dict(pp=2, pp_layers=[1, 3]), dict(zero=3)],
                         ids=["tp2-sp", "pp2-1-3", "zero3"])
@pytest.mark.parametrize("model", ["hybrid", "kimi"])  # Gated DeltaNet's or Kimi Delta Attention's layers
def test_hybrid_layouts_match_one_process(dist_world, run: dict, model: str) -> None:
    dist_world(2).run(check_layout, model, run)


def test_packed_documents_equal_each_document_alone() -> None:
    """Three documents packed in one 40-token sample (lengths 13, 17, 9, each closed by its EOD): per-token losses
    and every gradient equal each document run alone; the conv window and the state restart at each document (the
    unmasked run differs: the test can fail)."""
    cfg = hybrid_cfg(vocab_size=61)
    gen = torch.Generator().manual_seed(3)
    docs = [torch.cat([torch.randint(1, cfg.vocab_size, (n - 1,), generator=gen), torch.tensor([EOD])])
            for n in (13, 17, 9)]
    packed = torch.cat(docs + [torch.randint(1, cfg.vocab_size, (1,), generator=gen)])
    masked = GPT(cfg, ParallelState(), seed=5, context=ContextOptions(document_eod=EOD))
    got, got_grads = _losses_and_grads(masked, packed[None, :-1], packed[None, 1:])
    plain = GPT(cfg, ParallelState(), seed=5)
    want, want_grads, start = [], {}, 0
    for doc in docs:
        n = len(doc)
        loss, grads = _losses_and_grads(plain, packed[None, start:start + n], packed[None, start + 1:start + n + 1])
        want.append(loss[0])
        for name, g in grads.items():
            want_grads[name] = want_grads.get(name, 0) + g
        start += n
    torch.testing.assert_close(got[0], torch.cat(want), atol=TOL, rtol=0)
    assert any(".gdn." in n for n in got_grads)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], atol=TOL, rtol=TOL, msg=lambda m: f"{name}: {m}")
    unmasked, _ = _losses_and_grads(plain, packed[None, :-1], packed[None, 1:])
    assert (unmasked[0] - got[0]).abs().max() > 1e-3


def test_cached_generation_with_the_recurrent_state_equals_the_full_forward() -> None:
    """Greedy decoding (the linear layers carry their conv window and state, the full layer its KV cache) equals
    the full forward's argmax token for token, and the cached logits equal the forward's."""
    model = GPT(hybrid_cfg(vocab_size=61), ParallelState(), seed=5).eval()
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
    assert sum(c is not None for c in cache.recurrent.values()) == 3
    torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)


def _cfg(**model: object) -> Config:
    cfg = Config()
    cfg.model.num_layers, cfg.model.layer_types = 4, list(LINEAR_ARGS)
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


@pytest.mark.parametrize("model,parallel,says", [
    (dict(linear_num_key_heads=2, linear_num_value_heads=3), {}, "must be a multiple of linear_num_key_heads=2"),
    (dict(linear_conv_kernel_dim=0), {}, "linear_conv_kernel_dim=0 must be >= 1"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=6), dict(tp=2), "divisible by parallel.tp=2"),
    ({}, dict(cp=2), "parallel.cp=2 with linear_attention layers is not supported yet"),
])
def test_bad_linear_configs_say_what_is_wrong(model: dict, parallel: dict, says: str) -> None:
    cfg = _cfg(**model)
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    assert any(says in line for line in layer_problems(cfg)), layer_problems(cfg)
    assert not layer_problems(_cfg())


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
