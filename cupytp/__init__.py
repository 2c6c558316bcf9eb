"""cupytp: tensor-parallel and fully-sharded training on raw CuPy arrays, NCCL and MPI.

`import cupytp` checks the CUPYTP_* environment variables first (`cupytp.env`). The layers
below the models are imported here; the others (`cupytp.checkpoint`, `cupytp.optim`,
`cupytp.models`, ...) load on first use of the attribute, so `import cupytp` then
`cupytp.checkpoint.save(...)` works without importing the subpackage by name.
"""
import importlib

from cupytp import env

env.check()

from cupytp import backend  # noqa: E402
from cupytp.autograd import no_grad  # noqa: E402
from cupytp.distributed import DeviceMesh, init, init_device_mesh  # noqa: E402
from cupytp.graph import GraphCaptureError, cuda_graph  # noqa: E402
from cupytp.memory import (  # noqa: E402
    empty_cache, memory_stats, memory_summary, reset_peak_memory_stats, set_memory_limit)
from cupytp.ops import (  # noqa: E402
    ShardingError, autocast, concat, cross_entropy, dropout, einsum, embedding, gelu, layer_norm,
    log_softmax, matmul, softmax, split, stack)
from cupytp.tensor import (  # noqa: E402
    DTensor, Layout, Partial, Replicated, Shard, arange, deferred_init, distribute, from_local,
    full, local_mesh, manual_seed, microbatch, ones, rand, randn, zeros)
from cupytp.nn import materialize  # noqa: E402
from cupytp import parallel  # noqa: E402    data parallelism; gives Module.as_distributed

from cupytp import debug  # noqa: E402    after the layers it looks at

__version__ = "0.1.0"

# subpackages loaded on first attribute access (PEP 562)
LAZY_SUBMODULES = ("checkpoint", "data", "launchers", "models", "nn", "optim", "train_log")

__all__ = [
    "backend", "no_grad", "DeviceMesh", "init", "init_device_mesh", "GraphCaptureError",
    "cuda_graph", "empty_cache", "memory_stats", "memory_summary", "reset_peak_memory_stats",
    "set_memory_limit", "ShardingError", "autocast",
    "concat", "cross_entropy", "dropout", "einsum", "embedding", "gelu", "layer_norm",
    "log_softmax", "matmul", "softmax", "split", "stack", "DTensor", "Layout", "Partial",
    "Replicated", "Shard", "arange", "deferred_init", "materialize", "distribute", "from_local",
    "full", "local_mesh", "manual_seed", "microbatch", "ones", "rand", "randn", "zeros",
    "debug", "env", "parallel",
]


def __getattr__(name):
    if name in LAZY_SUBMODULES:
        return importlib.import_module(f"cupytp.{name}")   # also sets the attribute
    raise AttributeError(f"module 'cupytp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(LAZY_SUBMODULES))
