"""Build this rank's model chunks and the engine that runs them."""

from __future__ import annotations

import torch
import torch.nn as nn

from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.mla.config import MLAConfig
from megalite.model.gpt import GPT
from megalite.mtp.config import MTPConfig
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState
from megalite.pipeline.engine import PipelineEngine
from megalite.pipeline.partition import chunk_virtual_stages, virtual_stage_layers
from megalite.pipeline.schedules import V_SHAPED, layout_problems


def build_pipeline(model_cfg, state: ParallelState, seed: int, micro_batch_size: int, dtype: torch.dtype,
                   vpp: int = 1, pp_layers: list[int] | None = None, rng: RNGStreams | None = None,
                   schedule: str = "1f1b", context: ContextOptions = ContextOptions(),
                   mla: MLAConfig | None = None, mtp: MTPConfig | None = None) -> PipelineEngine:
    """One GPT chunk per virtual stage this rank holds (vpp of them), wired into a PipelineEngine;
    `schedule` zbv places the two chunks in a V (rank r: stages r and 2P-1-r); `mtp`: the multi-token
    prediction modules on the last stage (megalite/mtp)."""
    rng = rng or RNGStreams(seed, state)
    ranges = virtual_stage_layers(model_cfg.num_layers, state.pp, vpp, pp_layers)
    num_stages = len(ranges)
    v_shape = schedule in V_SHAPED
    if v_shape and (problems := layout_problems(schedule, state.pp, vpp)):
        raise ConfigError("; ".join(problems))
    stages = chunk_virtual_stages(state.pp_rank, state.pp, vpp, v_shape)
    chunks: list[nn.Module] = [GPT(model_cfg, state, seed, rng=rng, layers=ranges[vs], pre_process=vs == 0,
                                   post_process=vs == num_stages - 1, context=context, mla=mla,
                                   mtp=mtp).to(state.device)
                               for vs in stages]
    seq = model_cfg.seq_len // state.cp  # this rank's zigzag split of each sequence (context parallel)
    seq = seq // state.tp if state.sp else seq
    return PipelineEngine(chunks, stages, num_stages, state, (micro_batch_size, seq, model_cfg.hidden_size), dtype,
                          v_shape=v_shape)
