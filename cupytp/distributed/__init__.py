"""The distributed runtime: init(), process groups (NCCL, MPI), DeviceMesh, timeouts."""
from cupytp.distributed.device_mesh import DeviceMesh, init_device_mesh
from cupytp.distributed.process_group import (
    REDUCE_OPS, CollectiveTimeoutError, ProcessGroup, Work, split_sizes)
from cupytp.distributed.runtime import (
    NotInitializedError, Runtime, all_gather_object, barrier, broadcast_object, get_rank,
    get_runtime, get_world_size, init, is_initialized)

__all__ = [
    "DeviceMesh", "init_device_mesh", "REDUCE_OPS", "CollectiveTimeoutError", "ProcessGroup",
    "Work", "split_sizes", "NotInitializedError", "Runtime", "get_rank", "get_world_size", "init",
    "is_initialized", "get_runtime", "all_gather_object", "broadcast_object",
    "barrier",
]
