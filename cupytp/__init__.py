"""cupytp: tensor-parallel and fully-sharded training on raw CuPy arrays, NCCL and MPI."""
from cupytp import backend
from cupytp.autograd import no_grad
from cupytp.distributed import DeviceMesh, init, init_device_mesh
from cupytp.graph import GraphCaptureError, cuda_graph
from cupytp.memory import (
    empty_cache, memory_stats, memory_summary, reset_peak_memory_stats, set_memory_limit)
from cupytp.ops import (
    ShardingError, autocast, concat, cross_entropy, dropout, einsum, embedding, gelu, layer_norm,
    log_softmax, matmul, softmax, split, stack)
from cupytp.tensor import (
    DTensor, Layout, Partial, Replicated, Shard, arange, deferred_init, distribute, from_local,
    full, local_mesh, manual_seed, ones, rand, randn, zeros)
from cupytp.nn import materialize
from cupytp import parallel   # data parallelism; gives Module.as_distributed

from cupytp import debug      # after the layers it looks at

__version__ = "0.1.0"

__all__ = [
    "backend", "no_grad", "DeviceMesh", "init", "init_device_mesh", "GraphCaptureError",
    "cuda_graph", "empty_cache", "memory_stats", "memory_summary", "reset_peak_memory_stats",
    "set_memory_limit", "ShardingError", "autocast",
    "concat", "cross_entropy", "dropout", "einsum", "embedding", "gelu", "layer_norm",
    "log_softmax", "matmul", "softmax", "split", "stack", "DTensor", "Layout", "Partial",
    "Replicated", "Shard", "arange", "deferred_init", "materialize", "distribute", "from_local",
    "full", "local_mesh", "manual_seed", "ones", "rand", "randn", "zeros", "debug", "parallel",
]
