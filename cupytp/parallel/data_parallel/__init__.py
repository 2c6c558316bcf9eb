"""Data parallelism, the one home of gradient synchronization: replicated (DDP), fully sharded
(FSDP / ZeRO-3) and hybrid (HSDP) over the data-parallel dims of a mesh.

- `plan`: which dims replicate and which shard, where each parameter is split, and how
  parameters are packed into groups (sharding) and buckets (replicated gradients);
- `buffers`: the flat buffers that let one collective move a whole group or bucket;
- `schedule`: when bytes move (gathers before a group runs, bucket all-reduces as soon as
  backward has finished them, reduce-scatters of groups, no_sync);
- `api`: `replicate`, `fully_shard`, `data_parallel`.

Gradients reach the schedules as sinks of the parameters' gradient accumulation (replicated) or
as the gradients of gathered views (sharded): the tensor layer never reduces a gradient itself.
"""
from cupytp.nn.module import Module
from cupytp.parallel.data_parallel.api import (
    DataParallelModule, FSDPModule, as_distributed, data_parallel, fully_shard, replicate)
from cupytp.parallel.data_parallel.plan import DPDims, layers, plan_buckets, plan_groups
from cupytp.parallel.data_parallel.schedule import FSDPGroup, ReplicateSchedule, ShardSchedule

Module.as_distributed = as_distributed      # the nn layer does not import parallel

__all__ = ["DataParallelModule", "FSDPModule", "as_distributed", "data_parallel", "fully_shard",
           "replicate", "DPDims", "layers", "plan_buckets", "plan_groups", "FSDPGroup",
           "ReplicateSchedule", "ShardSchedule"]
