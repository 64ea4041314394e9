"""An MLA model decodes from its compressed KV cache (megalite/inference/generate.py: the latent c_kv and the
shared RoPE key per token and layer, W_UK absorbed into the query) with the logits of its ordinary forward, and
a checkpoint records its `[mla]` widths so `load_model` (tools/generate.py) rebuilds it. Tolerance as
tests/test_generate.py: the same fp32 math in another grouping (the absorbed form multiplies W_UK into q instead
of into the keys), a few ulps of the largest logit; a wrong position or scale is O(0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.checkpoint.sharded import read_index, save_sharded
from megalite.inference.generate import KVCache, SamplingConfig, forward_cached, generate_ids
from megalite.inference.load import load_model
from megalite.mla.config import MLAConfig
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.parallel_utils import tiny_model_cfg, with_sections

SEQ, VOCAB = 24, 97
MLA = MLAConfig(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
YARN = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_positions=8, rope_mscale=1.0,
            rope_mscale_all_dim=1.0)


def test_mla_decodes_from_the_compressed_cache(tmp_path: Path) -> None:
    cfg = tiny_model_cfg(vocab_size=VOCAB, seq_len=SEQ, hidden_size=64, num_heads=4, num_kv_heads=4, **YARN)
    model = GPT(with_sections(cfg, mla=MLA), ParallelState(), seed=3).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # sharpen the distribution: a random init at std 0.02 is near-uniform (ties)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    prompt = [5, 17, 3, 42, 8]
    cached = list(generate_ids(model, prompt, SamplingConfig(12), use_cache=True))
    assert cached == list(generate_ids(model, prompt, SamplingConfig(12), use_cache=False))
    ids = torch.tensor([prompt + cached])
    cache = KVCache(model, 1, torch.float32)
    # The cache holds kv_lora_rank + qk_rope_head_dim numbers per token and layer.
    assert sum(cache.k[n][0, 0].numel() + cache.v[n][0, 0].numel() for n in model.layers) == 2 * (16 + 8)
    got = torch.cat([forward_cached(model, ids[:, :5], cache)] +
                    [forward_cached(model, ids[:, i:i + 1], cache) for i in range(5, ids.shape[1])], dim=1)
    with torch.no_grad():
        want = model(ids)[..., :VOCAB]
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()

    ckpt = save_sharded(tmp_path / "ckpt", 1, model, None, {}, ParallelState(), keep=0)
    assert read_index(ckpt)["model"]["mla"] == vars(MLA)
    loaded, _ = load_model(ckpt)
    with torch.no_grad():
        assert torch.equal(loaded(ids)[..., :VOCAB], want)


def test_checkpoint_of_another_mla_shape_is_refused(tmp_path: Path) -> None:
    from megalite.checkpoint.sharded import load_sharded
    from megalite.errors import CheckpointError

    cfg = tiny_model_cfg(vocab_size=VOCAB, seq_len=SEQ, hidden_size=64, num_heads=4, num_kv_heads=4)
    ckpt = save_sharded(tmp_path / "c", 1, GPT(with_sections(cfg, mla=MLA), ParallelState(), seed=3), None, {}, ParallelState(),
                        keep=0)
    with pytest.raises(CheckpointError, match="mla"):
        load_sharded(ckpt, GPT(cfg, ParallelState(), seed=3), None, ParallelState())


def _tp_generation(rank: int) -> list[int]:
    from tests.parallel_utils import layout

    # init_std 0.5: sharp logits, so the tp run's different fp32 summation order cannot flip an argmax.
    cfg = tiny_model_cfg(vocab_size=VOCAB, seq_len=SEQ, hidden_size=64, num_heads=4, num_kv_heads=4, init_std=0.5,
                         **YARN)
    model = GPT(with_sections(cfg, mla=MLA), layout(2), seed=3).eval()
    reference = GPT(with_sections(cfg, mla=MLA), ParallelState(), seed=3).eval()  # the same weights: init is layout-invariant
    got = list(generate_ids(model, [5, 17, 3], SamplingConfig(12)))
    assert got == list(generate_ids(reference, [5, 17, 3], SamplingConfig(12), use_cache=False)), rank
    return got


def test_compressed_cache_decodes_tensor_parallel(dist_world) -> None:
    """At tp 2 each rank caches the whole (replicated) latent and absorbs its own heads' W_UK / W_UV."""
    first, second = dist_world(2).run(_tp_generation)
    assert first == second and len(first) == 12


def test_offline_reshard_of_an_mla_checkpoint(tmp_path: Path) -> None:
    """The offline tool's name rules (`layout_for`) give MLA's layouts (q_b / kv_b by heads, q_a / kv_a whole),
    and tp 1 -> tp 2 -> tp 1 returns every tensor bit for bit."""
    from megalite.checkpoint.layout import layout_for, layout_of, model_info
    from megalite.checkpoint.offline import reshard
    from megalite.checkpoint.storage import SlabReader
    from megalite.errors import ConfigError
    from megalite.parallel.param_spec import named_param_specs

    cfg = tiny_model_cfg(vocab_size=VOCAB, seq_len=SEQ, hidden_size=64, num_heads=4, num_kv_heads=4)
    model = GPT(with_sections(cfg, mla=MLA), ParallelState(), seed=3)
    info = model_info(cfg, MLA)
    specs = named_param_specs(model, ConfigError)
    assert {n: layout_for(n, info) for n in specs} == {n: layout_of(n, s.layout) for n, s in specs.items()}
    src = save_sharded(tmp_path / "a", 1, model, None, {}, ParallelState(), keep=0)
    back = reshard(reshard(src, tmp_path / "b", tp=2, show_progress=False), tmp_path / "c", show_progress=False)

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        index = read_index(path)
        reader = SlabReader(path, index)
        return {k: reader.read_region(k, (0,) * len(v["shape"]), tuple(v["shape"])) for k, v in index["tensors"].items()}

    before, after = tensors(src), tensors(back)
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)


def test_resume_takes_mla_and_rope_scaling_from_the_checkpoint(tmp_path: Path) -> None:
    """A run resuming an MLA + YaRN checkpoint without those flags takes them from it; a contradicting
    model.rope_* flag is refused in one line."""
    from megalite.checkpoint.model_shape import apply_checkpoint_shape
    from megalite.config.schema import Config
    from megalite.errors import CheckpointError

    cfg = tiny_model_cfg(vocab_size=VOCAB, seq_len=SEQ, hidden_size=64, num_heads=4, num_kv_heads=4, **YARN)
    save_sharded(tmp_path, 1, GPT(with_sections(cfg, mla=MLA), ParallelState(), seed=3), None, {}, ParallelState(), keep=0)
    run = Config()
    run.checkpoint.dir = str(tmp_path)
    run = apply_checkpoint_shape(run, [])
    assert vars(run.mla) == vars(MLA) and {k: getattr(run.model, k) for k in YARN} == YARN
    run = Config()
    run.checkpoint.dir, run.model.rope_factor = str(tmp_path), 8.0
    with pytest.raises(CheckpointError, match="model.rope_factor=8.0 but the checkpoint has 4.0"):
        apply_checkpoint_shape(run, ["--model.rope_factor", "8"])
