"""cupytp: tensor-parallel and fully-sharded training on raw CuPy arrays, NCCL and MPI."""
from cupytp import backend
from cupytp.distributed import DeviceMesh, init, init_device_mesh

__version__ = "0.1.0"
