"""Parallelization of whole models: tensor-parallel plans (with sequence parallelism), fully
sharded data parallelism, context parallelism (ring attention)."""
from cupytp.parallel.context import ContextParallel
from cupytp.parallel.fully_shard import FSDPGroup, FSDPModule, fully_shard, plan_groups
from cupytp.parallel.tensor_parallel import (
    apply_tensor_parallel, megatron_plan, parallelize_module, relayout)

__all__ = ["ContextParallel", "FSDPGroup", "FSDPModule", "fully_shard", "plan_groups",
           "apply_tensor_parallel", "megatron_plan", "parallelize_module", "relayout"]
