"""Build this rank's model chunks and the engine that runs them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from megalite.context.options import ContextOptions
from megalite.errors import ConfigError
from megalite.model.gpt import GPT
from megalite.parallel.random import RNGStreams
from megalite.parallel.state import ParallelState
from megalite.pipeline.engine import PipelineEngine
from megalite.pipeline.partition import chunk_virtual_stages, virtual_stage_layers
from megalite.pipeline.schedules import V_SHAPED, layout_problems


@dataclass(frozen=True)
class StagePlan:
    """How the layers are cut into stages and run (`parallel.vpp`, `parallel.pp_layers`, `parallel.schedule`):
    `vpp` chunks per rank, `pp_layers` layers per (virtual) stage in model order (None: an even split)."""

    vpp: int = 1
    pp_layers: list[int] | None = None
    schedule: str = "1f1b"


def build_pipeline(model_cfg, state: ParallelState, seed: int, micro_batch_size: int, dtype: torch.dtype,
                   stages: StagePlan = StagePlan(), rng: RNGStreams | None = None,
                   context: ContextOptions = ContextOptions()) -> PipelineEngine:
    """One GPT chunk per virtual stage this rank holds (`stages.vpp` of them), wired into a PipelineEngine;
    schedule zbv places the two chunks in a V (rank r: stages r and 2P-1-r)."""
    vpp, pp_layers, schedule = stages.vpp, stages.pp_layers, stages.schedule
    rng = rng or RNGStreams(seed, state)
    ranges = virtual_stage_layers(model_cfg.num_layers, state.pp, vpp, pp_layers)
    num_stages = len(ranges)
    v_shape = schedule in V_SHAPED
    if v_shape and (problems := layout_problems(schedule, state.pp, vpp)):
        raise ConfigError("; ".join(problems))
    mine = chunk_virtual_stages(state.pp_rank, state.pp, vpp, v_shape)  # this rank's virtual stages
    chunks: list[nn.Module] = [GPT(model_cfg, state, seed, rng=rng, layers=ranges[vs], pre_process=vs == 0,
                                   post_process=vs == num_stages - 1, context=context).to(state.device)
                               for vs in mine]
    seq = model_cfg.seq_len // state.cp  # this rank's zigzag split of each sequence (context parallel)
    seq = seq // state.tp if state.sp else seq
    return PipelineEngine(chunks, mine, num_stages, state, (micro_batch_size, seq, model_cfg.hidden_size), dtype,
                          v_shape=v_shape)
