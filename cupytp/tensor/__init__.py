"""DTensor, its Layout and placements, redistribution, factories and sharding-invariant RNG."""
from cupytp.tensor.deferred import (
    DeferredError, deferred_init, is_deferred, is_deferring, materialize_tensor)
from cupytp.tensor.dtensor import DTensor
from cupytp.tensor.factory import (
    arange, distribute, from_local, full, local_mesh, ones, rand, randn, zeros)
from cupytp.tensor.layout import Layout, LayoutError
from cupytp.tensor.placement import Partial, Placement, Replicated, Shard
from cupytp.tensor.random import (
    Generator, Microbatches, default_generator, manual_seed, microbatch)
from cupytp.tensor.redistribute import RedistributeError

__all__ = [
    "DeferredError", "deferred_init", "is_deferred", "is_deferring", "materialize_tensor",
    "DTensor", "arange", "distribute", "from_local", "full", "local_mesh", "ones", "rand",
    "randn", "zeros", "Layout", "LayoutError", "Partial", "Placement", "Replicated", "Shard",
    "Generator", "Microbatches", "default_generator", "manual_seed", "microbatch",
    "RedistributeError",
]
