"""Parallelization of whole models: tensor-parallel plans, fully sharded data parallelism,
pipeline stages and schedules."""
from cupytp.parallel.fully_shard import FSDPGroup, FSDPModule, fully_shard, plan_groups
from cupytp.parallel.pipeline import (
    Action, DecoderParts, Pipeline, PipelineError, PipelineStats, Schedule, ScheduleError,
    format_schedule, make_schedule, pipeline, theoretical_bubble)
from cupytp.parallel.tensor_parallel import (
    apply_tensor_parallel, megatron_plan, parallelize_module, relayout)

__all__ = ["FSDPGroup", "FSDPModule", "fully_shard", "plan_groups", "apply_tensor_parallel",
           "megatron_plan", "parallelize_module", "relayout", "Action", "DecoderParts",
           "Pipeline", "PipelineError", "PipelineStats", "Schedule", "ScheduleError",
           "format_schedule", "make_schedule", "pipeline", "theoretical_bubble"]
