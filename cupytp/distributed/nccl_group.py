"""ProcessGroupNCCL: collectives on device (CuPy) arrays through cupy.cuda.nccl.

Blocking calls (`async_op=False`) run on the caller's current stream: nothing to order, nothing
for the host to wait on. `async_op=True` runs on the group's own communication stream, after an
event recorded on the current stream (so it sees every write before the call); `Work.wait()`
makes the current stream wait for it. Neither blocks the host.

Hangs: a watchdog thread tracks the newest unfinished collective of each group; one that is not
done within the timeout is reported (op, group, ranks) and the whole job ended with a non-zero
exit code. Collectives recorded into a CUDA graph are not tracked while
capturing (nothing runs then); each replay of the graph is tracked instead (`track_replay`).
"""
import os
import sys
import threading
import time

import numpy

from cupytp import backend, graph
from cupytp.distributed.process_group import Pending, ProcessGroup

_COMPLETE = Pending()
_ABORT_GRACE_S = 20      # after MPI_Abort, when the process still runs

_NCCL_TYPES = {
    numpy.dtype(numpy.uint8): 1, numpy.dtype(numpy.int32): 2, numpy.dtype(numpy.int64): 4,
    numpy.dtype(numpy.float16): 6, numpy.dtype(numpy.float32): 7,
    numpy.dtype(numpy.float64): 8, backend.dtype("bf16"): 9,
}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def new_unique_id():
    from cupy.cuda import nccl
    return nccl.get_unique_id()


class _Watchdog(threading.Thread):
    """Ends the job when a collective overruns its group's timeout.

    Per group it watches one event: recorded after a collective when nothing of the group is
    being watched. When that event completes and the group has issued collectives since, it
    records a new event on the stream of the newest one (so a hung collective issued while an
    earlier one was watched is still caught), else it stops watching the group.
    """

    def __init__(self):
        super().__init__(name="cupytp-nccl-watchdog", daemon=True)
        self.tracked = {}               # group -> (event, op, start time, issued count)
        self.lock = threading.Lock()
        self.device = backend.xp.cuda.Device().id

    def track(self, group, event, op):
        with self.lock:
            if group not in self.tracked:
                self.tracked[group] = (event, op, time.monotonic(), group.issued)

    def run(self):
        backend.xp.cuda.Device(self.device).use()   # events and streams are this rank's GPU's
        while True:
            time.sleep(0.5)
            with self.lock:
                items = list(self.tracked.items())
            for group, (event, op, start, issued) in items:
                if event.done:
                    with self.lock:
                        if group.issued > issued:
                            stream, newest = group.newest
                            self.tracked[group] = (stream.record(), newest, time.monotonic(),
                                                   group.issued)
                        else:
                            self.tracked.pop(group, None)
                elif time.monotonic() - start > group.timeout:
                    group.fail(f"{group.describe(op)} did not complete within "
                               f"{group.timeout:g} s (CUPYTP_TIMEOUT)")


_watchdog = None


def _get_watchdog():
    global _watchdog
    if _watchdog is None:
        _watchdog = _Watchdog()
        _watchdog.start()
    return _watchdog


class ProcessGroupNCCL(ProcessGroup):
    """A group whose arrays live on this rank's GPU; an NCCL communicator carries the data.

    `unique_id` is the NCCL id that the group's first rank created and broadcast over MPI.
    """

    backend = "nccl"

    def __init__(self, ranks, rank, name, host_comm, unique_id, timeout=None):
        super().__init__(ranks, rank, name, host_comm, timeout)
        from cupy.cuda import nccl
        self._nccl = nccl
        self.comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self.comm_stream = backend.xp.cuda.Stream(non_blocking=True)
        self._watchdog = _get_watchdog()
        self.issued = 0                 # collectives launched, and (stream, op) of the newest
        self.newest = None
        # connect now, while every member is here: later collectives never block the host
        self.all_reduce(backend.xp.zeros(1, dtype=numpy.float32))
        backend.synchronize()

    def fail(self, message):
        """Report a hang and end the whole job with a non-zero exit code (called by the watchdog
        thread). The stuck kernel is left alone: aborting the communicator would let this rank's
        waiting host code carry on and exit cleanly before MPI_Abort ends the job; should
        MPI_Abort itself stall, the process exits on its own after a grace period."""
        sys.stderr.write(f"cupytp: {message}; ending the job\n")
        sys.stderr.flush()
        fallback = threading.Timer(_ABORT_GRACE_S, os._exit, (1,))
        fallback.daemon = True
        fallback.start()
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)

    def _reduction_dtype(self, dtype, op):
        return None

    def _launch(self, op, buffers, async_op, call):
        """Run `call(stream_ptr)` on the current stream, or (async) on the communication stream
        after the current stream's pending writes; returns the Pending of the transfer."""
        current = backend.xp.cuda.get_current_stream()
        capturing = graph.is_capturing()
        if capturing:
            graph.note_group(self)
        if not async_op:
            call(current.ptr)
            if not capturing:
                self._track(current, op)
            return _COMPLETE
        self.comm_stream.wait_event(current.record())
        call(self.comm_stream.ptr)
        finished = self.comm_stream.record()
        if not capturing:
            self._track(self.comm_stream, op, finished)

        def wait():  # `buffers` stay referenced until the current stream is ordered after us
            backend.xp.cuda.get_current_stream().wait_event(finished)
            buffers.clear()
        return Pending(wait, lambda: finished.done)

    def _track(self, stream, op, event=None):
        """Hand the newest collective, `op` on `stream` (done at `event`), to the watchdog."""
        self.newest = (stream, op)      # newest first: the watchdog reads issued, then it
        self.issued += 1
        if event is not None or self not in self._watchdog.tracked:
            self._watchdog.track(self, event or stream.record(), op)

    def track_replay(self, stream, what):
        """Watch a CUDA-graph replay launched on `stream` that runs this group's collectives."""
        self._track(stream, what)

    def _all_reduce(self, send, recv, op, async_op):
        return self._launch("all_reduce", [send, recv], async_op, lambda s: self.comm.allReduce(
            send.data.ptr, recv.data.ptr, send.size, _NCCL_TYPES[send.dtype], _NCCL_OPS[op], s))

    def _all_gather(self, send, recv, async_op):
        return self._launch("all_gather", [send, recv], async_op, lambda s: self.comm.allGather(
            send.data.ptr, recv.data.ptr, send.size, _NCCL_TYPES[send.dtype], s))

    def _reduce_scatter(self, send, recv, op, async_op):
        return self._launch(
            "reduce_scatter", [send, recv], async_op, lambda s: self.comm.reduceScatter(
                send.data.ptr, recv.data.ptr, recv.size, _NCCL_TYPES[send.dtype], _NCCL_OPS[op], s))

    def _broadcast(self, buffer, src, async_op):
        return self._launch("broadcast", [buffer], async_op, lambda s: self.comm.bcast(
            buffer.data.ptr, buffer.size, _NCCL_TYPES[buffer.dtype], src, s))

    def _exchange(self, sends, recvs, async_op, op="send/recv"):
        def call(stream_ptr):
            self._nccl.groupStart()
            try:
                for buf, peer in sends:
                    self.comm.send(buf.data.ptr, buf.size, _NCCL_TYPES[buf.dtype], peer,
                                   stream_ptr)
                for buf, peer in recvs:
                    self.comm.recv(buf.data.ptr, buf.size, _NCCL_TYPES[buf.dtype], peer,
                                   stream_ptr)
            finally:
                self._nccl.groupEnd()
        buffers = [buf for buf, _ in sends] + [buf for buf, _ in recvs]
        return self._launch(op, buffers, async_op, call)
