"""Host messages over MPI under a timeout.

Every wait polls its MPI requests and, past the timeout, raises a CollectiveTimeoutError that
names the operation, so a rank that never comes (it failed, skipped the call, or called another)
is an error on the others rather than a hang. Small picklable objects (shapes, seeds, verdicts
of a check) travel as bytes through MPI's nonblocking collectives: their sizes first, then the
bytes.
"""
import pickle
import time

import numpy


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the group's timeout."""


def poll(test, timeout, what):
    """Call `test()` until it returns True, yielding the core between tries (other ranks may
    share it); past `timeout` seconds, a CollectiveTimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    spins = 0
    while not test():
        spins += 1
        if spins > 64:  # let other ranks on the same cores run
            time.sleep(1e-5 if spins < 4096 else 1e-3)
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"{what} did not complete within {timeout:g} s (CUPYTP_TIMEOUT): a rank "
                "skipped it, called another collective, or is stuck")


def barrier(comm, timeout, what):
    """Return once every rank of `comm` has called it."""
    if comm.size > 1:
        poll(comm.Ibarrier().Test, timeout, what)


def all_gather_object(comm, obj, timeout, what):
    """Every rank's picklable `obj`, in `comm`'s rank order, on every rank."""
    if comm.size == 1:
        return [obj]
    data = _bytes(obj)
    sizes = numpy.empty(comm.size, dtype=numpy.int64)
    poll(comm.Iallgather(numpy.array([data.size], dtype=numpy.int64), sizes).Test, timeout,
         what)
    gathered = numpy.empty(int(sizes.sum()), dtype=numpy.uint8)
    poll(comm.Iallgatherv(data, [gathered, sizes.tolist()]).Test, timeout, what)
    ends = numpy.cumsum(sizes)
    return [pickle.loads(gathered[end - size:end].tobytes()) for size, end in zip(sizes, ends)]


def broadcast_object(comm, obj, root, timeout, what):
    """Rank `root`'s picklable `obj` on every rank of `comm`."""
    if comm.size == 1:
        return obj
    data = _bytes(obj) if comm.rank == root else None
    size = numpy.array([0 if data is None else data.size], dtype=numpy.int64)
    poll(comm.Ibcast(size, root=root).Test, timeout, what)
    if data is None:
        data = numpy.empty(int(size[0]), dtype=numpy.uint8)
    poll(comm.Ibcast(data, root=root).Test, timeout, what)
    return obj if comm.rank == root else pickle.loads(data.tobytes())


def _bytes(obj):
    return numpy.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                            dtype=numpy.uint8).copy()
