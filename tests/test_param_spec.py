"""One `ParamSpec` per parameter (`megalite.parallel.param_spec`): declared by the layers and the model,
found for every parameter whatever happens to the model, and required loudly by the optimizers and the
checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from megalite.checkpoint.sharded import load_sharded, save_sharded
from megalite.errors import CheckpointError, ConfigError
from megalite.model.gpt import GPT, count_parameters
from megalite.optim import build_distributed_optimizer
from megalite.parallel.param_spec import (EXPERT_PARALLEL, REPLICATED, ROW, VOCAB, MatrixStack, ParamSpec, Tied,
                                          TPLayout, column, named_param_specs, spec_table)
from megalite.parallel.state import ParallelState
from tests.parallel_utils import ADAMW, reference_optimizer, tiny_model_cfg

HYPER = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _gpt(arch: str = "llama", sp: bool = False, **kw) -> GPT:
    return GPT(tiny_model_cfg(arch), ParallelState(sp=sp), seed=1, **kw)


def test_every_layer_declares_its_parameters() -> None:
    """The specs the layers declare, for both architectures: what the optimizer and checkpoint rely on."""
    cfg = tiny_model_cfg("gpt2")
    specs = named_param_specs(GPT(cfg, ParallelState(sp=True), seed=1), ConfigError)
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    assert specs["embedding.weight"] == ParamSpec(VOCAB)  # tied in one stage: the head is this parameter
    assert "head.weight" not in specs
    assert specs["position"] == ParamSpec(REPLICATED, sp_partial=True)
    assert specs["layers.0.norm1.bias"] == ParamSpec(REPLICATED, sp_partial=True)
    assert specs["layers.1.attn.qkv.weight"] == specs["layers.1.attn.qkv.bias"] == ParamSpec(column((h, h, h)))
    assert specs["layers.1.attn.out.weight"] == specs["layers.0.mlp.down.weight"] == ParamSpec(ROW)
    assert specs["layers.1.attn.out.bias"] == ParamSpec(REPLICATED, sp_partial=True)
    assert specs["layers.0.mlp.up.weight"] == ParamSpec(column((f,)))
    llama = named_param_specs(_gpt("llama"), ConfigError)
    assert llama["layers.0.mlp.up.weight"] == ParamSpec(column((f, f)))  # gate and up, split separately
    assert llama["layers.0.norm2.weight"] == ParamSpec(REPLICATED)  # no SP: full gradients
    assert llama["head.weight"].layout == column((llama["head.weight"].layout.parts[0],))


def test_expert_weights_say_what_they_are() -> None:
    """MoE experts declare their weights as stacks of whole per-expert matrices, reduced as expert-parallel
    weights; Muon's planner and the FP8 filter derive what they need from that (no method on the module)."""
    from megalite.fp8.enable import stacked_dims
    from megalite.moe.experts import Experts, ExpertShape

    h, f = 16, 24
    for gated, up_rows in ((True, (f, f)), (False, (f,))):
        experts = Experts(ExpertShape(4, h, f, gated), ParallelState(), ops=None,  # type: ignore[arg-type]
                          name="e", seed=1, std=0.02, num_layers=2)
        specs = named_param_specs(experts, ConfigError)
        assert specs["up"] == ParamSpec(REPLICATED, grads=EXPERT_PARALLEL, stack=MatrixStack(up_rows))
        assert specs["down"] == ParamSpec(REPLICATED, grads=EXPERT_PARALLEL, stack=MatrixStack((h,)))
        assert sorted(set(stacked_dims(experts))) == [h, f]
    model = _gpt()
    assert all(s.stack is None and s.grads.split_over is None for s in named_param_specs(model, ConfigError).values())
    assert all(stacked_dims(m) == [] for m in model.modules())


def test_tied_embedding_roles_across_pipeline_stages() -> None:
    first = named_param_specs(_gpt("gpt2", layers=range(0, 1), post_process=False), ConfigError)
    last = named_param_specs(_gpt("gpt2", layers=range(1, 2), pre_process=False), ConfigError)
    assert first["embedding.weight"].tied is Tied.EMBEDDING and first["embedding.weight"].pipeline_tied
    assert last["head.weight"].tied is Tied.HEAD_COPY and last["head.weight"].pipeline_tied
    untied = named_param_specs(_gpt("llama", layers=range(1, 2), pre_process=False), ConfigError)
    assert untied["head.weight"].tied is Tied.NONE


def test_specs_survive_dtype_conversion_and_chunk_lists() -> None:
    model = _gpt("gpt2")
    before = named_param_specs(model, ConfigError)
    model.to(torch.bfloat16)
    assert named_param_specs(model, ConfigError) == before
    table = spec_table(model, ConfigError)
    assert all(table[p] == before[n] for n, p in model.named_parameters())
    chunks = nn.ModuleList([_gpt("llama", layers=range(0, 1), post_process=False),
                            _gpt("llama", layers=range(1, 2), pre_process=False)])
    named = named_param_specs(chunks, ConfigError)
    assert named["0.embedding.weight"] == ParamSpec(VOCAB) and named["1.layers.1.mlp.down.weight"] == ParamSpec(ROW)


def test_layouts_are_checked() -> None:
    assert not REPLICATED.split and ROW.split and VOCAB.split
    with pytest.raises(ValueError, match="parts"):
        TPLayout("column")
    with pytest.raises(ValueError, match="parts"):
        TPLayout("row", (4,))
    with pytest.raises(AttributeError):  # frozen: a spec cannot be edited in place
        ParamSpec(ROW).sp_partial = True  # type: ignore[misc]


def _with_extra_parameter() -> GPT:
    """A model with a parameter that no layer declares (what a new layer forgetting its spec looks like)."""
    model = _gpt("llama")
    model.layers["1"].mlp.scale = nn.Parameter(torch.ones(4))
    return model


def test_building_an_optimizer_names_a_parameter_without_spec() -> None:
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.scale .*no ParamSpec"):
        build_distributed_optimizer(_with_extra_parameter(), ParallelState(), 0, dtype=torch.float32, optimizer=ADAMW)
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.scale"):
        reference_optimizer(_with_extra_parameter(), ParallelState())
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.scale"):
        count_parameters(_with_extra_parameter(), ParallelState())


def test_saving_or_loading_a_checkpoint_names_a_parameter_without_spec(tmp_path: Path) -> None:
    st = ParallelState()
    model = _with_extra_parameter()
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.scale .*no ParamSpec"):
        save_sharded(tmp_path, 1, model, None, {}, st, keep=1)
    assert not any(tmp_path.iterdir())  # failed before writing anything
    good = _gpt("llama")
    path = save_sharded(tmp_path, 1, good, reference_optimizer(good, st), {}, st, keep=1)
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.scale"):
        load_sharded(path, model, None, st)
