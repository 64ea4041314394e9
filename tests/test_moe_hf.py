"""Hugging Face MixtralForCausalLM both ways: a transformers-built tiny Mixtral's weights in a megalite GPT give
the same logits and greedy generation, and megalite's weights written back load into transformers unchanged.
Qwen3-MoE and unsupported fields are refused with one line.

Tolerance: fp32, the same math (megalite's mixtral router is a softmax over the top-k logits, transformers'
a softmax over all then renormalised: equal up to round-off), so logits agree to 1e-5 on O(1) values."""

from __future__ import annotations

import pytest
import torch

from megalite.checkpoint.hf_moe import hf_moe_config, hf_weights, load_hf_weights, moe_fields_from_hf
from megalite.errors import CheckpointError
from megalite.inference.generate import SamplingConfig, generate_ids
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.moe_utils import tiny_moe_cfg


def _pair():
    from transformers import MixtralConfig, MixtralForCausalLM

    hf_cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(hf_cfg).eval()
    fields = moe_fields_from_hf(hf_cfg.to_dict())
    cfg = tiny_moe_cfg(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, seq_len=32, num_layers=2,
                       ffn_hidden_size=48, tie_embeddings=False, **{**fields, "moe_aux_loss": 0.0, "moe_z_loss": 0.0})
    model = GPT(cfg, ParallelState(), seed=1).eval()
    return hf, model


def test_mixtral_logits_and_greedy_generation_equal_transformers() -> None:
    hf, model = _pair()
    load_hf_weights(model, hf.state_dict())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)[..., :64]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    prompt = [3, 17, 5]
    ours = list(generate_ids(model, prompt, SamplingConfig(max_new_tokens=8)))
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert ours == theirs


def test_megalite_weights_back_to_transformers() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    hf, model = _pair()
    state = hf_weights(model)  # megalite's own init, written as HF tensors
    back = MixtralForCausalLM(MixtralConfig(**hf_moe_config(model.cfg))).eval()
    missing = set(back.state_dict()) - set(state)
    assert not missing, missing
    back.load_state_dict(state, strict=True)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :64], back(ids).logits, atol=1e-5, rtol=0)


def test_unsupported_hf_moe_configs_are_one_line() -> None:
    with pytest.raises(CheckpointError, match="q_norm, k_norm"):
        moe_fields_from_hf({"model_type": "qwen3_moe"})
    with pytest.raises(CheckpointError, match="router_jitter_noise must be 0"):
        moe_fields_from_hf({"model_type": "mixtral", "router_jitter_noise": 0.1, "num_local_experts": 4})
