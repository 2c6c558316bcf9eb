"""Parallelization of whole models: tensor-parallel plans (with sequence parallelism); data
parallelism (replicated, fully sharded, hybrid), the one home of gradient synchronization;
context parallelism (ring attention); pipeline stages and schedules."""
from cupytp.parallel.context import ContextParallel
from cupytp.parallel.data_parallel import (
    DataParallelModule, FSDPGroup, FSDPModule, data_parallel, fully_shard, plan_buckets,
    plan_groups, replicate)
from cupytp.parallel.pipeline import (
    Action, DecoderParts, Pipeline, PipelineError, PipelineStats, Schedule, ScheduleError,
    format_schedule, make_schedule, pipeline, theoretical_bubble)
from cupytp.parallel.tensor_parallel import (
    apply_tensor_parallel, megatron_plan, parallelize_module, relayout)

__all__ = ["ContextParallel", "DataParallelModule", "FSDPGroup", "FSDPModule", "data_parallel",
           "fully_shard", "plan_buckets", "plan_groups", "replicate", "apply_tensor_parallel",
           "megatron_plan", "parallelize_module", "relayout", "Action", "DecoderParts",
           "Pipeline", "PipelineError", "PipelineStats", "Schedule", "ScheduleError",
           "format_schedule", "make_schedule", "pipeline", "theoretical_bubble"]
