"""`init()`: the MPI world, this rank's GPU, and the process groups every mesh is built from.

MPI launches the ranks (mpiexec of Open MPI or MPICH, any launcher that gives MPI, or a plain
single process). The local rank comes from an MPI shared-memory split and picks the GPU. Groups
are created collectively: every rank calls `new_group` in the same order; the group's first rank
makes the NCCL unique id and broadcasts it over the group's MPI communicator.
"""
import os
import sys
import time
import traceback
from dataclasses import dataclass

from cupytp import backend, memory
from cupytp.distributed import host
from cupytp.distributed.process_group import add_observer, debug_enabled, default_timeout

ABORT_GRACE = 1.0       # seconds between printing an uncaught error and aborting the job


class NotInitializedError(RuntimeError):
    """A distributed call came before cupytp.init()."""


@dataclass(frozen=True)
class Runtime:
    """What init() found: this rank, the world, the device and the collective backend."""
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    device: str                 # "cpu", or "gpu:<index>"
    backend: str                # "nccl" or "mpi"
    timeout: float


_runtime = None
_world_comm = None
_groups = {}                    # tuple of global ranks -> ProcessGroup


def init(backend_name=None, timeout=None):
    """Start the distributed runtime (idempotent) and return its `Runtime`.

    backend_name: "nccl" (default on GPU) or "mpi" (default on CPU; host arrays only).
    timeout: seconds a collective may take before it is an error (default CUPYTP_TIMEOUT or 600).
    On a GPU, CuPy's arrays then come from the framework's pool (`cupytp.memory`), unless
    CUPYTP_ALLOCATOR=cupy.
    """
    global _runtime, _world_comm
    if _runtime is not None:
        return _runtime
    from mpi4py import MPI
    wanted = backend_name or ("nccl" if backend.on_gpu else "mpi")
    if wanted not in ("nccl", "mpi"):
        raise ValueError(f"backend {wanted!r} is not one of 'nccl', 'mpi'")
    if wanted == "nccl" and not backend.on_gpu:
        raise ValueError("the nccl backend needs a GPU; this process computes on the CPU "
                         "(CUPYTP_DEVICE or no usable GPU): use backend 'mpi'")
    if wanted == "mpi" and backend.on_gpu:
        raise ValueError("the mpi backend carries host arrays, but arrays live on the GPU: use "
                         "backend 'nccl' or CUPYTP_DEVICE=cpu")
    allocator = memory.allocator_choice()
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    local_rank, local_size = local.rank, local.size
    local.Free()
    device = "cpu"
    if backend.on_gpu:
        count = backend.xp.cuda.runtime.getDeviceCount()
        if local_size > count:
            raise RuntimeError(f"{local_size} ranks share this node but it has {count} GPU(s): "
                               f"launch at most {count} ranks per node")
        backend.xp.cuda.Device(local_rank).use()
        device = f"gpu:{local_rank}"
        if allocator == "cupytp":
            memory.install()            # CuPy arrays come from the framework's pool from now on
    _world_comm = world
    _runtime = Runtime(rank=world.rank, world_size=world.size, local_rank=local_rank,
                       local_size=local_size, device=device, backend=wanted,
                       timeout=default_timeout() if timeout is None else float(timeout))
    if world.size > 1:
        sys.excepthook = _abort_on_uncaught
    if debug_enabled():
        from cupytp.distributed.fingerprint import FingerprintCheck
        add_observer(FingerprintCheck())
    return _runtime


def is_initialized():
    return _runtime is not None


def get_runtime():
    """The Runtime of init(); an error before it."""
    if _runtime is None:
        raise NotInitializedError("cupytp.init() must be called before anything distributed "
                                  "(meshes, process groups, DTensors)")
    return _runtime


def world_comm():
    """The MPI communicator over every rank (host metadata: shapes, seeds, ...)."""
    get_runtime()
    return _world_comm


def all_gather_object(obj):
    """Every rank's small picklable `obj`, in rank order, on every rank (host, over MPI, under
    the timeout)."""
    return host.all_gather_object(world_comm(), obj, _runtime.timeout,
                                  _over_world("all_gather_object"))


def broadcast_object(obj, src=0):
    """Rank `src`'s small picklable `obj` on every rank (host, over MPI, under the timeout)."""
    return host.broadcast_object(world_comm(), obj, src, _runtime.timeout,
                                 _over_world("broadcast_object"))


def barrier():
    """Return once every rank of the job has called barrier() (host only: no device work;
    under the timeout)."""
    host.barrier(world_comm(), _runtime.timeout, _over_world("barrier"))


def _over_world(op):
    return f"{op} over the world ({_runtime.world_size} ranks, this is rank {_runtime.rank})"


def self_group():
    """A one-rank group holding only this process (its collectives return at once)."""
    info = get_runtime()
    if "self" not in _groups:
        from mpi4py import MPI
        from cupytp.distributed.mpi_group import ProcessGroupMPI
        _groups["self"] = ProcessGroupMPI((info.rank,), 0, "self", MPI.COMM_SELF, info.timeout)
    return _groups["self"]


def get_rank():
    return get_runtime().rank


def get_world_size():
    return get_runtime().world_size


def new_group(color, key, name):
    """Create (collectively, over the world) the group of ranks sharing `color`, ordered by `key`.

    Every rank calls this in the same order. A group over the same ranks as an earlier one is
    the earlier one: one communicator per set of ranks.
    """
    info = get_runtime()
    host.barrier(_world_comm, info.timeout, _over_world(f"creating process group {name!r}"))
    sub = _world_comm.Split(color, key)     # every rank is here: the split cannot wait forever
    ranks = tuple(sub.allgather(info.rank))
    if ranks in _groups:
        sub.Free()
        return _groups[ranks]
    if info.backend == "nccl" and len(ranks) > 1:
        from cupytp.distributed.nccl_group import ProcessGroupNCCL, new_unique_id
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")   # connect at init, not mid-step
        unique_id = sub.bcast(new_unique_id() if sub.rank == 0 else None, root=0)
        group = ProcessGroupNCCL(ranks, sub.rank, name, sub, unique_id, info.timeout)
    else:
        from cupytp.distributed.mpi_group import ProcessGroupMPI
        group = ProcessGroupMPI(ranks, sub.rank, name, sub, info.timeout)
    _groups[ranks] = group
    return group


def _abort_on_uncaught(kind, value, tb):
    """An uncaught error on one rank ends every rank (instead of leaving them in a collective)."""
    traceback.print_exception(kind, value, tb)
    sys.stderr.flush()
    time.sleep(ABORT_GRACE)     # the launcher forwards what was printed before it kills the job
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)
