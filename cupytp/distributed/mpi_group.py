"""ProcessGroupMPI: collectives on host (NumPy) arrays through mpi4py.

Every transfer is a non-blocking MPI call polled against the group's timeout, so a rank that
never joins turns into a CollectiveTimeoutError instead of a hang. MPI has no bfloat16 or float16
reduction and no average: those reduce in float32 (sum, then divide).
"""
import numpy
from mpi4py import MPI

from cupytp import backend
from cupytp.distributed.process_group import Pending, ProcessGroup, poll

_MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
_NO_MPI_TYPE = (backend.dtype("bf16"), backend.dtype("fp16"))
_DATA_TAG = 0


def _buffer(array):
    """The array as an mpi4py buffer; 2-byte floats travel as uint16 (bytes only, no math)."""
    if array.dtype in _NO_MPI_TYPE:
        return array.view(numpy.uint16)
    return array


def pending(requests, group, op, buffers=()):
    """The Pending of MPI `requests` of `op` on `group`: wait() polls them against the group's
    timeout and raises CollectiveTimeoutError past it. `buffers` (the arrays the requests read
    and write) stay referenced until then: mpi4py does not keep them alive, and a buffer freed
    while a request is in flight is read after its memory has been reused."""
    held = list(buffers)

    def wait():
        poll(lambda: MPI.Request.Testall(requests), group, op)
        held.clear()
    return Pending(wait, lambda: MPI.Request.Testall(requests))


class ProcessGroupMPI(ProcessGroup):
    """A group whose arrays live on the host; `host_comm` carries the data."""

    backend = "mpi"

    def _reduction_dtype(self, dtype, op):
        if dtype in _NO_MPI_TYPE:
            return numpy.dtype(numpy.float32)
        return dtype if op == "avg" else None

    def _pending(self, requests, op, buffers):
        return pending(requests, self, op, buffers)

    def _all_reduce(self, send, recv, op, async_op):
        request = self.host_comm.Iallreduce(MPI.IN_PLACE if send is recv else send, recv,
                                            op=_MPI_OPS[op])
        return self._pending([request], "all_reduce", (send, recv))

    def _all_gather(self, send, recv, async_op):
        request = self.host_comm.Iallgather(_buffer(send), _buffer(recv))
        return self._pending([request], "all_gather", (send, recv))

    def _reduce_scatter(self, send, recv, op, async_op):
        request = self.host_comm.Ireduce_scatter_block(send, recv, op=_MPI_OPS[op])
        return self._pending([request], "reduce_scatter", (send, recv))

    def _broadcast(self, buffer, src, async_op):
        request = self.host_comm.Ibcast(_buffer(buffer), root=src)
        return self._pending([request], "broadcast", (buffer,))

    def _exchange(self, sends, recvs, async_op, op="send/recv"):
        # tag 0 on both sides: a receive must not take the host messages other code sends
        # over the same communicator with tags of their own (CUPYTP_DEBUG's checks)
        requests = [self.host_comm.Irecv(_buffer(buf), source=peer, tag=_DATA_TAG)
                    for buf, peer in recvs]
        requests += [self.host_comm.Isend(_buffer(buf), dest=peer, tag=_DATA_TAG)
                     for buf, peer in sends]
        return self._pending(requests, op, [buf for buf, _ in sends + recvs])
