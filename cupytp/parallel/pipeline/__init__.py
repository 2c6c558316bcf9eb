"""Pipeline parallelism: a decoder cut into stages along the "pp" mesh dimension, run by
schedules that are tables of per-rank actions (GPipe, 1F1B, interleaved 1F1B, ZB-H1)."""
from cupytp.parallel.pipeline.executor import PipelineError, PipelineStats
from cupytp.parallel.pipeline.runtime import Pipeline, pipeline
from cupytp.parallel.pipeline.schedules import (
    Action, Schedule, ScheduleError, Timeline, format_schedule, make_schedule, simulate,
    theoretical_bubble)
from cupytp.parallel.pipeline.stages import DecoderParts, PipelineStage, split_layers

__all__ = ["Pipeline", "PipelineError", "PipelineStats", "pipeline", "Action", "Schedule",
           "ScheduleError", "Timeline", "format_schedule", "make_schedule", "simulate",
           "theoretical_bubble", "DecoderParts", "PipelineStage", "split_layers"]
