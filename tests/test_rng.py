"""Building a model has no global side effects, and its dropout streams are explicit generators.

`RNGStreams` used to reseed torch's default generator; it now owns both of its generators. These tests
pin the three things that must hold: construction leaves torch's global RNG state as it found it, the
replicated stream draws what the default generator did after `torch.manual_seed` with the same seed
(so dropout runs are bit for bit what they were), and code drawing from the global generator between
steps no longer shifts the model's dropout masks.
"""

from __future__ import annotations

import torch

from megalite.model.gpt import GPT
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState
from megalite.pipeline.build import build_pipeline
from tests.parallel_utils import tiny_model_cfg


def test_building_a_model_leaves_the_global_rng_untouched() -> None:
    cfg = tiny_model_cfg("gpt2", dropout=0.1)
    torch.manual_seed(987)
    torch.rand(3)  # any state, not just a freshly seeded one
    before = torch.get_rng_state()
    model = GPT(cfg, ParallelState(), seed=5)
    build_pipeline(cfg, ParallelState(), seed=5, micro_batch_size=2, dtype=torch.float32)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(1)  # and the weights do not depend on the global state (drawn from (seed, name))
    again = GPT(cfg, ParallelState(), seed=5)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name


def test_replicated_stream_draws_what_the_seeded_default_generator_drew() -> None:
    """The masks earlier versions drew (torch.manual_seed(seed + 100 * pp_rank), then the default generator)."""
    x = torch.ones(4, 33)
    for pp_rank in (0, 1):
        state = ParallelState(pp=2, rank=pp_rank)
        streams = RNGStreams(11, state)
        got = [streams.dropout(x, 0.5, training=True, tp_local=False) for _ in range(2)]
        torch.manual_seed(11 + 100 * pp_rank)
        want = [x * (torch.rand(x.shape) >= 0.5).float() / 0.5 for _ in range(2)]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert not torch.equal(got[0], got[1])  # the stream advances


def test_global_draws_between_steps_do_not_change_dropout_masks() -> None:
    cfg = tiny_model_cfg("gpt2", dropout=0.3)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    outs = []
    for meddle in (False, True):
        model = GPT(cfg, ParallelState(), seed=5).train()
        first = model(ids)
        if meddle:
            torch.randn(1000)  # e.g. a data loader or a user's own sampling
        outs.append((first, model(ids)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], outs[0][1])  # dropout is on: the two steps drew different masks


def test_stream_state_round_trips() -> None:
    streams = RNGStreams(3, ParallelState())
    x = torch.ones(64)
    saved = streams.state_dict()
    a = [streams.dropout(x, 0.5, True, tp_local) for tp_local in (False, True)]
    streams.load_state_dict(saved)
    b = [streams.dropout(x, 0.5, True, tp_local) for tp_local in (False, True)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
