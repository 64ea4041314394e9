"""Pipeline parallelism: stage partitioning, schedules as action lists, the engine that runs them."""

from megalite.pipeline.build import StagePlan, build_pipeline
from megalite.pipeline.engine import PipelineEngine
from megalite.pipeline.schedules import build_schedule, max_in_flight

__all__ = ["PipelineEngine", "StagePlan", "build_pipeline", "build_schedule", "max_in_flight"]
