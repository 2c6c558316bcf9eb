"""ProcessGroup: how bytes move between the ranks of one group.

The base class owns everything both backends share: argument checks (before any communication),
dims other than 0, uneven sizes (numpy.array_split rule: the first ranks get one more), the
average of integer and low-precision types, and the `Work` handle of `async_op=True`. A backend
supplies only flat, equal-count primitives: `_all_reduce`, `_all_gather`, `_reduce_scatter`,
`_broadcast` and `_exchange` (a batch of point-to-point sends and receives), each taking the
caller's `async_op` and returning a `Pending` that completes the transfer.

Point-to-point: `send`, `recv` and `batch_isend_irecv` (sends and receives with several peers
posted together, as one NCCL group: two ranks that send to each other do not wait on each
other). They run under the same timeout as the collectives; a receive whose send never comes is
a CollectiveTimeoutError naming both ranks.

Results are new arrays; they may be the input itself on a group of one rank, and on the source
rank of a broadcast.

Observers (CUPYTP_DEBUG's fingerprint check, `cupytp.debug.CommTracer`) see every public
collective of a group of more than one rank, before it starts and once it is done; with none
registered, a call costs one list test.
"""
import functools
import inspect

import numpy

from cupytp import backend, env
from cupytp.distributed import host
from cupytp.distributed.host import CollectiveTimeoutError  # noqa: F401 (raised by the groups)

REDUCE_OPS = frozenset(("sum", "avg", "max", "min", "prod"))
SUPPORTED_DTYPES = frozenset(backend.dtype(name) for name in
                             ("bf16", "fp16", "fp32", "fp64", "int32", "int64", "uint8"))


def default_timeout():
    """Seconds a collective may take: CUPYTP_TIMEOUT, else 600."""
    return env.get("CUPYTP_TIMEOUT")


def debug_enabled():
    """CUPYTP_DEBUG=1: collectives compared across ranks before they run, from_local checked."""
    return env.get("CUPYTP_DEBUG")


def split_sizes(length, parts):
    """Extents of `parts` chunks of `length` by the numpy.array_split rule."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class Pending:
    """A transfer that a backend has started; `wait()` completes it, `done()` polls it.
    `Pending()` is one that is already complete."""

    def __init__(self, wait=None, done=None):
        self._wait = wait
        self._done = done

    def wait(self):
        if self._wait is not None:
            self._wait()

    def done(self):
        return True if self._done is None else self._done()


class Work:
    """A collective in flight (`async_op=True`). `wait()` returns its result.

    On the NCCL backend `wait()` orders the caller's current stream after the collective (no host
    synchronization); on MPI it blocks until the transfer is done.
    """

    def __init__(self, pending, finish):
        self._pending = pending
        self._finish = finish
        self._result = None
        self._completed = False

    def wait(self):
        if not self._completed:
            self._pending.wait()
            self._result = self._finish()
            self._completed = True
        return self._result

    def is_completed(self):
        return self._completed or self._pending.done()


def _done(result):
    return Work(Pending(), lambda: result)


# ---- observers ----------------------------------------------------------------------------------
_observers = []


def add_observer(observer):
    """Show every collective to `observer`: `observer.before(call)` before it starts (it may
    raise to stop it) and `observer.after(call)` once it is done (at `Work.wait()` when async)."""
    _observers.append(observer)


def remove_observer(observer):
    _observers.remove(observer)


class Call:
    """One collective as observers see it: the group, the op name, `detail` (its arguments
    that every rank must share), the global `shape` and `dtype` it moves, and this rank's
    `nbytes`. A point-to-point call has `peers` instead: one ("send" or "recv", group rank of
    the peer, shape, dtype name) per transfer, and `nbytes` counts what it sends and receives.
    `state` is free for observers to use."""
    __slots__ = ("group", "op", "detail", "shape", "dtype", "nbytes", "peers", "state")

    def __init__(self, group, op, detail, shape, dtype, nbytes, peers=None):
        self.group, self.op, self.detail = group, op, detail
        self.shape, self.dtype, self.nbytes = shape, dtype, nbytes
        self.peers = peers
        self.state = {}


def _observed(describe):
    """Decorate a public collective: with observers registered (and more than one rank),
    `describe(group, **arguments)` gives the Call's (detail, shape, dtype, nbytes)."""
    def wrap(method):
        signature = inspect.signature(method)

        @functools.wraps(method)
        def run(self, *args, **kwargs):
            if not _observers or self.size == 1:
                return method(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            del arguments["self"]
            try:
                call = Call(self, method.__name__, *describe(self, **arguments))
            except (AttributeError, TypeError, ValueError, IndexError):
                return method(self, *args, **kwargs)     # bad arguments: its own clear error
            observers = list(_observers)
            for observer in observers:
                observer.before(call)
            result = method(self, *args, **kwargs)
            if isinstance(result, Work):
                finish = result._finish

                def finished():
                    value = finish()
                    for observer in reversed(observers):
                        observer.after(call)
                    return value
                result._finish = finished
            else:
                for observer in reversed(observers):
                    observer.after(call)
            return result
        return run
    return wrap


def _gathered_shape(array, dim, sizes, size):
    shape = list(array.shape)
    dim = dim % max(array.ndim, 1)
    shape[dim] = sum(sizes) if sizes is not None else array.shape[dim] * size
    return tuple(shape)


def _describe_reduce(group, array, op="sum", async_op=False, dim=None, in_place=False):
    detail = f"op={op}" if dim is None else f"dim={dim}, op={op}"
    return detail, tuple(array.shape), str(array.dtype), array.nbytes


def _describe_gather(group, array, dim=0, sizes=None, async_op=False, dst=None):
    detail = f"dim={dim}" if dst is None else f"dst={dst}, dim={dim}"
    return (detail, _gathered_shape(array, dim, sizes, group.size), str(array.dtype),
            array.nbytes)


def _describe_broadcast(group, array, src=0, async_op=False):
    return f"src={src}", tuple(array.shape), str(array.dtype), array.nbytes


def _describe_scatter(group, array, src=0, dim=0, shape=None, dtype=None, async_op=False):
    shape = tuple(array.shape) if array is not None else tuple(shape or ())
    dtype = array.dtype if array is not None else backend.dtype(dtype or "fp32")
    nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize // group.size
    return f"src={src}, dim={dim}", shape, str(dtype), nbytes


def _describe_all_to_all(group, inputs, out_shapes=None, async_op=False):
    nbytes = sum(a.nbytes for peer, a in enumerate(inputs) if peer != group.rank)
    return f"{len(inputs)} parts", None, str(inputs[0].dtype) if inputs else None, nbytes


def _describe_p2p(sends, recvs):
    """(detail, shape, dtype, nbytes, peers) of point-to-point transfers: `sends` as (array,
    dst), `recvs` as (shape, dtype, src)."""
    peers = [("send", dst, tuple(a.shape), str(a.dtype)) for a, dst in sends] + \
        [("recv", src, tuple(shape), str(backend.dtype(dtype))) for shape, dtype, src in recvs]
    nbytes = sum(a.nbytes for a, _ in sends) + sum(
        int(numpy.prod(tuple(shape), dtype=numpy.int64)) * backend.dtype(dtype).itemsize
        for shape, dtype, _ in recvs)
    detail = ", ".join(f"{kind} {shape} {'to' if kind == 'send' else 'from'} {peer}"
                       for kind, peer, shape, _ in peers)
    return detail, None, peers[0][3] if peers else None, nbytes, peers


def _describe_send(group, array, dst, async_op=False):
    return _describe_p2p([(array, dst)], [])


def _describe_recv(group, shape, dtype, src, async_op=False):
    return _describe_p2p([], [(shape, dtype, src)])


def _describe_batch(group, sends=(), recvs=()):
    return _describe_p2p(list(sends), list(recvs))


def _describe_sendrecv(group, array, dst, src, shape=None, async_op=False):
    return _describe_p2p([(array, dst)], [(array.shape if shape is None else shape,
                                           array.dtype, src)])


class ProcessGroup:
    """The ranks `ranks` (global ranks, in group order); this process is `self.rank` among them."""

    backend = "base"

    def __init__(self, ranks, rank, name, host_comm, timeout=None):
        self.ranks = tuple(int(r) for r in ranks)
        self.rank = int(rank)
        self.size = len(self.ranks)
        self.name = name
        self.host_comm = host_comm          # an MPI communicator over the same ranks
        self.timeout = default_timeout() if timeout is None else float(timeout)

    def __repr__(self):
        return (f"{type(self).__name__}(name={self.name!r}, ranks={list(self.ranks)}, "
                f"rank={self.rank})")

    def describe(self, op):
        return f"{op} on group {self.name!r} (global ranks {list(self.ranks)}, this is rank " \
               f"{self.ranks[self.rank]})"

    # ---- checks -------------------------------------------------------------------------------
    def _check(self, op, array, reduce_op=None):
        if not isinstance(array, backend.xp.ndarray):
            raise TypeError(f"{op}: expected a {backend.xp.__name__} array, got "
                            f"{type(array).__name__}")
        if array.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise TypeError(f"{op}: dtype {array.dtype} is not supported (use one of {names})")
        if reduce_op is not None and reduce_op not in REDUCE_OPS:
            raise ValueError(f"{op}: reduce op {reduce_op!r} is not one of {sorted(REDUCE_OPS)}")

    def _check_dim(self, op, array, dim):
        if not -array.ndim <= dim < array.ndim:
            raise ValueError(f"{op}: dim {dim} is out of range for an array of shape "
                             f"{array.shape}")
        return dim % array.ndim

    def _check_peer(self, op, peer):
        if not 0 <= peer < self.size or not isinstance(peer, int):
            raise ValueError(f"{op}: rank {peer} is not in group {self.name!r} of size "
                             f"{self.size}")

    def _check_other(self, op, peer, verb):
        self._check_peer(op, peer)
        if peer == self.rank:
            raise ValueError(f"{op}: rank {peer} cannot {verb} itself on group {self.name!r}")

    @staticmethod
    def _run(pending, finish, async_op):
        if async_op:
            return Work(pending, finish)
        pending.wait()
        return finish()

    # ---- collectives ----------------------------------------------------------------------------
    @_observed(_describe_reduce)
    def all_reduce(self, array, op="sum", async_op=False, in_place=False):
        """Every rank gets the elementwise reduction (`op`) of all ranks' arrays; with
        `in_place`, written into `array` (C-contiguous) itself, which is the result."""
        self._check("all_reduce", array, op)
        if in_place and not backend.c_contiguous(array):
            raise ValueError("all_reduce: in_place needs a C-contiguous array")
        if self.size == 1:
            return _done(array) if async_op else array
        send = array if array.flags.c_contiguous else backend.xp.ascontiguousarray(array)
        recv = send if in_place else backend.xp.empty_like(send)
        pending, finish = self._reduce_into(send, recv, op, self._all_reduce, async_op)
        return self._run(pending, finish, async_op)

    @_observed(_describe_reduce)
    def reduce_scatter(self, array, dim=0, op="sum", async_op=False):
        """Reduce across ranks, then keep this rank's chunk of `dim` (array_split sizes)."""
        self._check("reduce_scatter", array, op)
        dim = self._check_dim("reduce_scatter", array, dim)
        if self.size == 1:
            return _done(array) if async_op else array
        xp = backend.xp
        sizes = split_sizes(array.shape[dim], self.size)
        longest = sizes[0]
        moved = xp.moveaxis(array, dim, 0) if dim else array
        if sizes[-1] == longest:
            send = moved if moved.flags.c_contiguous else xp.ascontiguousarray(moved)
        else:  # pad every chunk to the longest so the flat primitive sees equal counts
            send = xp.zeros((self.size * longest,) + moved.shape[1:], dtype=array.dtype)
            starts = numpy.cumsum([0] + sizes)
            for i, n in enumerate(sizes):
                send[i * longest:i * longest + n] = moved[starts[i]:starts[i] + n]
        recv = xp.empty((longest,) + moved.shape[1:], dtype=array.dtype)
        pending, finish = self._reduce_into(send, recv, op, self._reduce_scatter, async_op)

        def result():
            return xp.moveaxis(finish()[:sizes[self.rank]], 0, dim)
        return self._run(pending, result, async_op)

    @_observed(_describe_gather)
    def all_gather(self, array, dim=0, sizes=None, async_op=False):
        """Concatenate every rank's array along `dim`; `sizes` gives each rank's extent there
        when they differ (default: all equal to this rank's)."""
        self._check("all_gather", array, None)
        dim = self._check_dim("all_gather", array, dim)
        sizes = self._gather_sizes("all_gather", array, dim, sizes)
        if self.size == 1:
            return _done(array) if async_op else array
        xp = backend.xp
        longest = max(sizes)
        moved = xp.moveaxis(array, dim, 0) if dim else array
        if moved.shape[0] == longest:
            send = moved if moved.flags.c_contiguous else xp.ascontiguousarray(moved)
        else:  # pad to the longest so the flat primitive sees equal counts
            send = xp.zeros((longest,) + moved.shape[1:], dtype=array.dtype)
            send[:moved.shape[0]] = moved
        recv = xp.empty((self.size * longest,) + moved.shape[1:], dtype=array.dtype)
        pending = self._all_gather(send, recv, async_op)
        return self._run(pending, lambda: self._unpad(recv, sizes, longest, dim), async_op)

    @_observed(_describe_broadcast)
    def broadcast(self, array, src=0, async_op=False):
        """Every rank gets rank `src`'s array; `array` on other ranks gives shape and dtype."""
        self._check("broadcast", array, None)
        self._check_peer("broadcast", src)
        if self.size == 1:
            return _done(array) if async_op else array
        xp = backend.xp
        if self.rank == src:
            buffer = array if array.flags.c_contiguous else xp.ascontiguousarray(array)
        else:
            buffer = xp.empty_like(array)
        pending = self._broadcast(buffer, src, async_op)
        return self._run(pending, lambda: buffer, async_op)

    @_observed(_describe_scatter)
    def scatter(self, array, src=0, dim=0, shape=None, dtype=None, async_op=False):
        """Rank `src` splits `array` along `dim` (array_split sizes); each rank gets its chunk.

        Ranks other than `src` pass `array=None` with the full `shape` and `dtype`.
        """
        self._check_peer("scatter", src)
        if self.rank == src:
            self._check("scatter", array, None)
            shape, dtype = array.shape, array.dtype
        elif shape is None or dtype is None:
            raise ValueError("scatter: ranks other than src must pass shape= and dtype= of the "
                             "full array")
        shape, dtype = tuple(shape), backend.dtype(dtype)
        dim = dim % len(shape)
        sizes = split_sizes(shape[dim], self.size)
        if self.size == 1:
            return _done(array) if async_op else array
        xp = backend.xp
        chunk_shape = shape[:dim] + (sizes[self.rank],) + shape[dim + 1:]
        recv = xp.empty(chunk_shape, dtype=dtype)
        sends = []
        if self.rank == src:
            starts = numpy.cumsum([0] + sizes)
            index = [slice(None)] * len(shape)
            for peer in range(self.size):
                index[dim] = slice(starts[peer], starts[peer + 1])
                sends.append((xp.ascontiguousarray(array[tuple(index)]), peer))
        pending = self._exchange(sends, [(recv, src)], async_op)
        return self._run(pending, lambda: recv, async_op)

    @_observed(_describe_gather)
    def gather(self, array, dst=0, dim=0, sizes=None, async_op=False):
        """Rank `dst` gets every rank's array concatenated along `dim`; others get None."""
        self._check("gather", array, None)
        self._check_peer("gather", dst)
        dim = self._check_dim("gather", array, dim)
        sizes = self._gather_sizes("gather", array, dim, sizes)
        if self.size == 1:
            return _done(array) if async_op else array
        xp = backend.xp
        moved = xp.ascontiguousarray(xp.moveaxis(array, dim, 0))
        sends = [(moved, dst)]
        recvs = []
        if self.rank == dst:
            recvs = [(xp.empty((n,) + moved.shape[1:], dtype=array.dtype), peer)
                     for peer, n in enumerate(sizes)]
        pending = self._exchange(sends, recvs, async_op)

        def result():
            if self.rank != dst:
                return None
            return xp.moveaxis(xp.concatenate([buf for buf, _ in recvs]), 0, dim)
        return self._run(pending, result, async_op)

    @_observed(_describe_all_to_all)
    def all_to_all(self, inputs, out_shapes=None, async_op=False):
        """Send `inputs[j]` to rank j; return the list of arrays received, from rank 0 up.

        `out_shapes[j]` is the shape coming from rank j (default: `inputs[j].shape`).
        """
        if len(inputs) != self.size:
            raise ValueError(f"all_to_all: {len(inputs)} inputs for a group of {self.size} ranks")
        for array in inputs:
            self._check("all_to_all", array, None)
        out_shapes = [a.shape for a in inputs] if out_shapes is None else list(out_shapes)
        if len(out_shapes) != self.size:
            raise ValueError(f"all_to_all: {len(out_shapes)} out_shapes for {self.size} ranks")
        xp = backend.xp
        outputs = [xp.empty(tuple(s), dtype=inputs[0].dtype) for s in out_shapes]
        outputs[self.rank] = inputs[self.rank]
        sends = [(xp.ascontiguousarray(a), peer) for peer, a in enumerate(inputs)
                 if peer != self.rank]
        recvs = [(buf, peer) for peer, buf in enumerate(outputs) if peer != self.rank]
        pending = self._exchange(sends, recvs, async_op) if self.size > 1 else Pending()
        return self._run(pending, lambda: outputs, async_op)

    # ---- point to point -------------------------------------------------------------------------
    @_observed(_describe_send)
    def send(self, array, dst, async_op=False):
        """Send `array` to rank `dst` of this group; with `async_op=True` returns a Work (the
        array must not change until it is waited for)."""
        pending, _ = self._p2p("send", [(array, dst)], [], async_op)
        return self._run(pending, lambda: None, async_op)

    @_observed(_describe_recv)
    def recv(self, shape, dtype, src, async_op=False):
        """Receive an array of `shape` and `dtype` from rank `src` of this group (a Work giving
        it with `async_op=True`)."""
        pending, outs = self._p2p("recv", [], [(shape, dtype, src)], async_op)
        return self._run(pending, lambda: outs[0], async_op)

    @_observed(_describe_batch)
    def batch_isend_irecv(self, sends=(), recvs=()):
        """Post sends and receives with any peers together (one NCCL group; non-blocking MPI
        calls) and return a Work whose wait() gives the received arrays, in the order of
        `recvs`. `sends`: (array, dst) pairs; `recvs`: (shape, dtype, src) triples. Ranks that
        send to each other in one batch never wait on each other. On NCCL the transfers run on
        the communication stream and wait() orders the current stream after them (no host
        synchronization, so a CUDA graph can capture them); the arrays sent must not change
        until then."""
        pending, outs = self._p2p("batch_isend_irecv", list(sends), list(recvs), True)
        return self._run(pending, lambda: outs, True)

    def _p2p(self, op, sends, recvs, async_op):
        """Check, then post `sends` [(array, dst)] and `recvs` [(shape, dtype, src)]: the
        Pending of the transfers and the arrays they receive into."""
        xp = backend.xp
        for array, dst in sends:
            self._check(op, array, None)
            self._check_other(op, dst, "send to")
        outs = []
        for shape, dtype, src in recvs:
            self._check_other(op, src, "receive from")
            outs.append(xp.empty(tuple(shape), dtype=backend.dtype(dtype)))
            self._check(op, outs[-1], None)
        if not sends and not recvs:
            return Pending(), outs
        label = "; ".join([f"send to global rank {self.ranks[dst]}" for _, dst in sends] +
                          [f"recv from global rank {self.ranks[src]}" for _, _, src in recvs])
        moved = [(xp.ascontiguousarray(array), dst) for array, dst in sends]
        received = [(out, src) for out, (_, _, src) in zip(outs, recvs)]
        return self._exchange(moved, received, async_op, label), outs

    @_observed(_describe_sendrecv)
    def sendrecv(self, array, dst, src, shape=None, async_op=False):
        """Send `array` to rank `dst` while receiving an array of `shape` (default: array's) and
        array's dtype from rank `src`, in one batch: a ring's step, every rank sending to its
        successor and receiving from its predecessor at once. Returns the array received (on a
        group of one rank: `array` itself); with `async_op=True` a Work whose wait() gives it."""
        shape = tuple(array.shape) if shape is None else tuple(int(n) for n in shape)
        if self.size == 1:
            if shape != array.shape:
                raise ValueError(f"sendrecv: on a group of one rank the array received is the "
                                 f"one sent, of shape {array.shape}, not {shape}")
            return _done(array) if async_op else array
        pending, outs = self._p2p("sendrecv", [(array, dst)], [(shape, array.dtype, src)],
                                  async_op)
        return self._run(pending, lambda: outs[0], async_op)

    def barrier(self):
        """Return once every rank of the group has called barrier."""
        if self.size > 1:
            self.all_reduce(backend.xp.zeros(1, dtype=numpy.int32))
            backend.synchronize()

    def broadcast_object(self, obj, src=0):
        """A small picklable object from rank `src` to all ranks (host, over MPI, under the
        group's timeout)."""
        self._check_peer("broadcast_object", src)
        return host.broadcast_object(self.host_comm, obj, src, self.timeout,
                                     self.describe("broadcast_object"))

    def all_gather_object(self, obj):
        """Every rank's small picklable object, in group order (host, over MPI, under the
        group's timeout)."""
        return host.all_gather_object(self.host_comm, obj, self.timeout,
                                      self.describe("all_gather_object"))

    def send_object(self, obj, dst):
        """Send a small picklable object to rank `dst` (host, over MPI, not waiting for it to
        arrive); returns a Work to wait for before the end of the program."""
        self._check_other("send_object", dst, "send to")
        request = self.host_comm.isend(obj, dest=dst, tag=_OBJECT_TAG)
        return Work(_object_pending(request, self, f"send_object to rank {dst}"), lambda: None)

    def recv_object(self, src):
        """A Work whose wait() gives the next object rank `src` sends with send_object (host,
        over MPI; under the group's timeout, like the collectives)."""
        self._check_other("recv_object", src, "receive from")
        request = self.host_comm.irecv(source=src, tag=_OBJECT_TAG)
        received = []
        return Work(_object_pending(request, self, f"recv_object from rank {src}", received),
                    lambda: received[0])

    # ---- shared helpers -----------------------------------------------------------------------
    def _gather_sizes(self, op, array, dim, sizes):
        if sizes is None:
            return [array.shape[dim]] * self.size
        sizes = [int(n) for n in sizes]
        if len(sizes) != self.size or sizes[self.rank] != array.shape[dim]:
            raise ValueError(f"{op}: sizes {sizes} do not fit group size {self.size} with this "
                             f"rank's extent {array.shape[dim]} along dim {dim}")
        return sizes

    def _unpad(self, recv, sizes, longest, dim):
        xp = backend.xp
        if all(n == longest for n in sizes):
            gathered = recv
        else:
            gathered = xp.concatenate([recv[i * longest:i * longest + n]
                                       for i, n in enumerate(sizes)])
        return xp.moveaxis(gathered, 0, dim) if dim else gathered

    def _reduce_into(self, send, recv, op, primitive, async_op):
        """Run a reducing primitive; returns (pending, finish) where finish() gives `recv` holding
        the result. Types a backend cannot reduce natively go through float32 (or float64)."""
        wide = self._reduction_dtype(send.dtype, op)
        if wide is None:
            return primitive(send, recv, op, async_op), lambda: recv
        native_op = "sum" if op == "avg" else op
        wide_recv = backend.xp.empty(recv.shape, dtype=wide)
        pending = primitive(send.astype(wide), wide_recv, native_op, async_op)

        def finish():
            result = wide_recv
            if op == "avg":
                result = _average(result, self.size, send.dtype)
            recv[...] = result
            return recv
        return pending, finish

    # ---- what a backend provides ----------------------------------------------------------------
    def _reduction_dtype(self, dtype, op):
        """None when the backend reduces `dtype` with `op` natively, else the dtype to reduce in."""
        raise NotImplementedError

    def _all_reduce(self, send, recv, op, async_op):
        raise NotImplementedError

    def _all_gather(self, send, recv, async_op):
        raise NotImplementedError

    def _reduce_scatter(self, send, recv, op, async_op):
        raise NotImplementedError

    def _broadcast(self, buffer, src, async_op):
        raise NotImplementedError

    def _exchange(self, sends, recvs, async_op, op="send/recv"):
        """Post `sends` [(array, dst)] and receives into `recvs` [(array, src)] together; `op`
        names them in a timeout's message."""
        raise NotImplementedError


_OBJECT_TAG = 7501         # host messages of send_object / recv_object


def poll(test, group, op):
    """Call `test()` until it returns True; past the group's timeout, a CollectiveTimeoutError
    naming `op` on the group."""
    host.poll(test, group.timeout, group.describe(op))


def _object_pending(request, group, op, received=None):
    """The Pending of an mpi4py object request (what it receives appended to `received`)."""
    def test():
        done, value = request.test()
        if done and received is not None:
            received.append(value)
        return done
    return Pending(lambda: poll(test, group, op))


def _average(total, count, dtype):
    """`total / count` in `dtype`; integers truncate toward zero, as NCCL's average does."""
    xp = backend.xp
    if numpy.issubdtype(dtype, numpy.integer):
        return xp.sign(total) * (xp.abs(total) // count)
    return total / count
