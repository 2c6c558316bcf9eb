"""The framework's device memory pool: a caching allocator with per-stream free lists.

On a GPU, `install()` (called by `cupytp.init()` unless CUPYTP_ALLOCATOR=cupy) makes a
`CachingAllocator` over raw cudaMalloc segments the allocator of every CuPy array. The pool is
pure-Python bookkeeping over a *backing allocator*, any object with `malloc(nbytes) ->
(address, handle)` (MemoryError when out of memory) and `free(handle)`, so on the CPU the tests
drive the same code with fake addresses.

Sizes and segments, as PyTorch's CUDACachingAllocator chooses them:
- a request is rounded up to 512 B;
- small requests (<= 1 MiB) are carved from 2 MiB segments; requests up to 10 MiB from 20 MiB
  segments shared by several blocks; a larger one gets a segment of its own, rounded up to
  2 MiB. Small and large blocks never share a segment, so small ones do not fragment large ones;
- a free block is split when the rest would be at least 512 B (small) or 1 MiB (large), and a
  freed block merges with the free neighbours of its segment: when no free block is large
  enough for a request, before a new segment is taken (see `_FreeList`);
- oversize blocks (256 MiB and up: a long sequence's logits and their gradient) are never split
  and serve only requests at most 20 MiB smaller (PyTorch's `max_split_size` rule, on by
  default here). Carved up, a freed logits segment would be pinned by the next pass's
  activations (or the optimizer's first states), and every step would take new ones; whole, it
  serves the next logits, or goes back when memory runs short.

Finding a block: the free blocks of one stream and one size class are bucketed by size, so a
loop that allocates the same sizes every step finds each in one dict lookup; otherwise best fit
(the smallest free block that is large enough, by bisection over the sorted sizes).

Streams: a block belongs to the stream it was allocated on (the caller passes the stream's
pointer). Once freed it serves the next allocation on that stream at once (stream order makes
that safe without a synchronization) and is never handed to another stream.

Private pools (`new_private_pool()`, `use_pool(pool)`) serve CUDA graphs, whose captured
addresses must stay valid: a private pool shares the backing allocator, keeps its own blocks and
statistics, and returns its segments only on `empty_cache()` or when it is dropped. A block
always goes back to the pool that gave it out, whichever pool is in use when it is freed.

Where memory goes: after `record_origins()` every allocation remembers the code that asked for
it, and `live_by_origin()` sums the live blocks per place (what holds memory between steps).
"""
import contextlib
import numbers
import os
import threading
import traceback
import weakref
from bisect import bisect_left, insort

from cupytp import backend, env

MiB = 2 ** 20
ALIGNMENT = 512                 # every block size is a multiple of this
SMALL_REQUEST = 1 * MiB         # requests up to this size are small ...
SMALL_SEGMENT = 2 * MiB         # ... and are carved from segments of this size
HUGE_REQUEST = 10 * MiB         # requests from here on get a segment of their own ...
HUGE_ROUNDING = 2 * MiB         # ... rounded up to a multiple of this
LARGE_SEGMENT = 20 * MiB        # other large requests share segments of this size
LARGE_SPLIT = 1 * MiB           # a large block is split only when the rest is at least this
OVERSIZE = 256 * MiB            # blocks this large are never split ...
OVERSIZE_SLACK = 20 * MiB       # ... and serve only requests less than this smaller

CUDA_ERROR_MEMORY_ALLOCATION = 2

STAT_KEYS = (
    "allocated_bytes",          # bytes in blocks handed out and not yet freed (rounded sizes)
    "allocated_bytes_peak",     # the most allocated_bytes since creation or reset_peak()
    "reserved_bytes",           # bytes of the segments held from the backing allocator
    "reserved_bytes_peak",      # the most reserved_bytes since creation or reset_peak()
    "active_blocks",            # blocks handed out and not yet freed
    "segments",                 # segments held from the backing allocator
    "allocations",              # allocations served
    "cache_hits",               # allocations served without calling the backing allocator
    "backing_mallocs",          # segments obtained from the backing allocator
    "backing_frees",            # segments given back to it
    "out_of_memory",            # OutOfMemoryError raised
)


class OutOfMemoryError(MemoryError):
    """The pool could not serve an allocation (limit reached, or the device is full); the
    message ends with the pool's summary."""


def segment_size(size):
    """Bytes of the segment a new block of `size` (already rounded) is carved from."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < HUGE_REQUEST:
        return LARGE_SEGMENT
    return -(-size // HUGE_ROUNDING) * HUGE_ROUNDING


class Block:
    """Bytes [address, address + size) of one segment; `prev`/`next` are its neighbours there."""
    __slots__ = ("address", "size", "segment", "prev", "next", "free")

    def __init__(self, address, size, segment, prev, next_):
        self.address, self.size, self.segment = address, size, segment
        self.prev, self.next, self.free = prev, next_, True

    @property
    def stream(self):
        return self.segment.free_list.stream


class _Segment:
    """One allocation of the backing allocator; its blocks go to `free_list` when free."""
    __slots__ = ("address", "size", "handle", "free_list")

    def __init__(self, address, size, handle, free_list):
        self.address, self.size, self.handle, self.free_list = address, size, handle, free_list


class _FreeList:
    """The free blocks of one stream and one size class: a bucket per size (a dict used as an
    ordered set, last freed first out) and the bucket sizes in order, for best fit. A bucket
    emptied by an allocation stays until a best-fit search passes it, so a size that is
    allocated and freed every step is one lookup each way.

    Merging is deferred: a freed block waits in `unmerged` (an ordered set) and merges with the
    free neighbours of its segment only when no free block is large enough for a request (or
    the cache is emptied). A loop that frees and allocates the same sizes every step thus
    neither merges nor splits, and a new segment is taken only when no merged run of free
    blocks would serve."""
    __slots__ = ("stream", "buckets", "sizes", "unmerged")

    def __init__(self, stream):
        self.stream, self.buckets, self.sizes, self.unmerged = stream, {}, [], {}

    def add(self, block):
        bucket = self.buckets.get(block.size)
        if bucket is None:
            bucket = self.buckets[block.size] = {}
            insort(self.sizes, block.size)
        bucket[block] = None

    def discard(self, block):
        del self.buckets[block.size][block]

    def take(self, size):
        """A free block of exactly `size`, else the smallest larger one (merging the waiting
        frees first when none is large enough), else None."""
        bucket = self.buckets.get(size)
        block = bucket.popitem()[0] if bucket else self._best_fit(size)
        if block is None and self.unmerged:
            self.merge()
            block = self._best_fit(size)
        if block is not None:
            self.unmerged.pop(block, None)
        return block

    def _best_fit(self, size):
        """The smallest free block of at least `size` that may serve it: one below OVERSIZE, or
        an oversize one less than OVERSIZE_SLACK larger than the request."""
        buckets, sizes = self.buckets, self.sizes
        bound = max(OVERSIZE, size + OVERSIZE_SLACK)
        i = bisect_left(sizes, size)
        while i < len(sizes) and sizes[i] < bound:
            bucket = buckets[sizes[i]]
            if bucket:
                return bucket.popitem()[0]
            del buckets[sizes[i]], sizes[i]          # an emptied bucket: drop it
        return None

    def merge(self):
        """Merge each waiting freed block with the free neighbours of its segment."""
        unmerged, self.unmerged = self.unmerged, {}
        for block in unmerged:
            if block.segment is None:                           # merged away already
                continue
            while block.prev is not None and block.prev.free:   # the free run's first block
                block = block.prev
            after = block.next
            if after is None or not after.free:
                continue
            self.discard(block)
            while after is not None and after.free:             # absorbs the rest of the run
                self.discard(after)
                block.size += after.size
                after.segment = None
                after = after.next
            block.next = after
            if after is not None:
                after.prev = block
            self.add(block)

    def whole_segments(self):
        """The free blocks that span their whole segment (after merging the waiting frees)."""
        if self.unmerged:
            self.merge()
        return [block for bucket in self.buckets.values() for block in bucket
                if block.prev is None and block.next is None]

    def prune(self):
        """Drop the emptied buckets."""
        for size in [size for size, bucket in self.buckets.items() if not bucket]:
            del self.buckets[size]
        self.sizes = sorted(self.buckets)


class _Family:
    """What a pool shares with its private pools: the backing allocator, the memory limit, one
    lock, the frees waiting for it, and the byte totals over all of them."""

    def __init__(self, backing, limit):
        self.backing, self.limit = backing, limit
        self.lock = threading.Lock()
        self.pending = []                # (pool, block) freed while the lock was held
        self.pools = weakref.WeakSet()
        self.root = None                 # weak reference to the pool the family started from
        self.allocated = self.allocated_peak = self.reserved = self.reserved_peak = 0

    def drain(self):
        """Return the pending frees (the lock is held)."""
        pending = self.pending
        while pending:
            pool, block = pending.pop()
            pool._release(block)


def _give_back(family, segments, segment):
    """Return one segment to the backing allocator (by its pool, or by its pool's finalizer)."""
    family.backing.free(segment.handle)
    segment.handle = None
    del segments[segment.address]
    family.reserved -= segment.size


def _give_back_all(family, segments):
    for segment in list(segments.values()):
        _give_back(family, segments, segment)


def _check_limit(limit):
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or limit < 0:
        raise ValueError(f"memory limit must be a number of bytes >= 0 or None, got {limit!r}")
    return int(limit)


class CachingAllocator:
    """A caching allocator over `backing` (see the module docstring). `limit`: the most bytes
    this pool and its private pools together may reserve (None: no limit).

    Thread safety: one lock per family of pools. A free that finds the lock held (another
    thread, or a finalizer run by the garbage collector inside an allocation) is queued and
    done by the holder before it lets go, or by the family's next call."""

    def __init__(self, backing, limit=None):
        self._join(_Family(backing, _check_limit(limit)))
        self._family.root = weakref.ref(self)

    def _join(self, family):
        self._family = family
        self._small = {}                 # stream -> _FreeList of blocks <= SMALL_REQUEST
        self._large = {}                 # stream -> _FreeList of larger blocks
        self._segments = {}              # address -> _Segment
        self._allocated = self._allocated_peak = self._reserved = self._reserved_peak = 0
        self._active = self._allocations = self._hits = 0
        self._mallocs = self._frees = self._ooms = 0
        family.pools.add(self)
        finalizer = weakref.finalize(self, _give_back_all, family, self._segments)
        finalizer.atexit = False         # at exit the device goes away with its memory

    def new_private_pool(self):
        """A new pool with this pool's backing allocator and limit, and its own blocks."""
        pool = CachingAllocator.__new__(CachingAllocator)
        pool._join(self._family)
        return pool

    # ---- allocation -------------------------------------------------------------------------

    def malloc(self, nbytes, stream=0):
        """A `Block` of at least `nbytes` for use on `stream` (the stream's pointer, an int)."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        size = ((nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT) or ALIGNMENT
        small = size <= SMALL_REQUEST
        family = self._family
        with family.lock:
            free_list = (self._small if small else self._large).get(stream)
            bucket = None if free_list is None else free_list.buckets.get(size)
            if bucket:                   # take()'s first case, inlined: the usual one
                block = bucket.popitem()[0]
                if free_list.unmerged:
                    free_list.unmerged.pop(block, None)
            else:
                block = None if free_list is None else free_list.take(size)
            if block is None:
                block = self._new_segment(size, small, stream)
            else:
                self._hits += 1
            if block.size - size >= (ALIGNMENT if small else LARGE_SPLIT) and \
                    block.size < OVERSIZE:
                self._split(block, size)
            block.free = False
            size = block.size
            self._allocated += size
            if self._allocated > self._allocated_peak:
                self._allocated_peak = self._allocated
            family.allocated += size
            if family.allocated > family.allocated_peak:
                family.allocated_peak = family.allocated
            self._active += 1
            self._allocations += 1
            if family.pending:
                family.drain()
        return block

    def free(self, block):
        """Give `block` back to this pool, the one that handed it out."""
        family = self._family
        if not family.lock.acquire(False):
            family.pending.append((self, block))     # the lock's holder returns it
            return
        try:
            self._release(block)
            if family.pending:
                family.drain()
        finally:
            family.lock.release()

    def _release(self, block):
        if block.free:
            raise ValueError(f"the block at {block.address:#x} ({block.size} B) is already "
                             "free: it was freed twice")
        block.free = True
        self._allocated -= block.size
        self._family.allocated -= block.size
        self._active -= 1
        free_list = block.segment.free_list
        bucket = free_list.buckets.get(block.size)
        if bucket is None:
            free_list.add(block)
        else:                            # add()'s usual case, inlined
            bucket[block] = None
        free_list.unmerged[block] = None

    def _split(self, block, size):
        """Keep the first `size` bytes of `block`; the rest becomes a free block."""
        rest = Block(block.address + size, block.size - size, block.segment, block, block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        free_list = block.segment.free_list
        free_list.add(rest)
        if rest.next is not None and rest.next.free:     # a neighbour whose merge is deferred
            free_list.unmerged[rest] = None

    def _new_segment(self, size, small, stream):
        """A free block spanning a new segment for a request of `size` (lock held)."""
        nbytes = segment_size(size)
        family = self._family
        if family.limit is not None and family.reserved + nbytes > family.limit:
            self._release_cached()
            if family.reserved + nbytes > family.limit:
                raise self._out_of_memory(
                    size, f"a new {nbytes} B segment would take reserved memory past the limit "
                          f"of {family.limit} B")
        try:
            address, handle = family.backing.malloc(nbytes)
        except MemoryError:
            self._release_cached()
            try:
                address, handle = family.backing.malloc(nbytes)
            except MemoryError as err:
                raise self._out_of_memory(size, f"the device has no free {nbytes} B segment, "
                                                f"even after releasing cached ones ({err})"
                                          ) from err
        lists = self._small if small else self._large
        free_list = lists.get(stream)
        if free_list is None:
            free_list = lists[stream] = _FreeList(stream)
        segment = self._segments[address] = _Segment(address, nbytes, handle, free_list)
        self._mallocs += 1
        self._reserved += nbytes
        self._reserved_peak = max(self._reserved_peak, self._reserved)
        family.reserved += nbytes
        family.reserved_peak = max(family.reserved_peak, family.reserved)
        return Block(address, nbytes, segment, None, None)

    def _out_of_memory(self, size, why):
        self._ooms += 1
        return OutOfMemoryError(
            f"out of device memory allocating {size} B: {why}. Free arrays that are no longer "
            "needed, lower the batch size, or raise cupytp.set_memory_limit().\n"
            + self._summary(family=True))

    def _release_cached(self):
        """Before an out-of-memory error: give back this pool's cached segments and the
        default (root) pool's; other private pools keep theirs (lock held)."""
        self._family.drain()
        self._empty_cache()
        root = self._family.root()
        if root is not None and root is not self:
            root._empty_cache()

    # ---- cache and statistics ---------------------------------------------------------------

    def empty_cache(self):
        """Give every wholly free segment back to the backing allocator (this pool only)."""
        with self._family.lock:
            self._family.drain()
            self._empty_cache()

    def _empty_cache(self):
        family = self._family
        for lists in (self._small, self._large):
            for free_list in lists.values():
                for block in free_list.whole_segments():
                    free_list.discard(block)
                    self._reserved -= block.size
                    self._frees += 1
                    _give_back(family, self._segments, block.segment)
                free_list.prune()

    def set_memory_limit(self, limit):
        """The most bytes this pool and its private pools together may reserve (None: none)."""
        self._family.limit = _check_limit(limit)

    def stats(self, family=False):
        """A dict with the keys of STAT_KEYS. This pool's own, or with `family`: this pool and
        its private pools together (counters summed, bytes and peaks of the pools together)."""
        with self._family.lock:
            self._family.drain()
            return self._stats(family)

    def _stats(self, family):
        pools = list(self._family.pools) if family else [self]
        stats = dict.fromkeys(STAT_KEYS, 0)
        for pool in pools:
            for key, value in pool._counters().items():
                stats[key] += value
        if family:
            f = self._family
            stats.update(allocated_bytes=f.allocated, allocated_bytes_peak=f.allocated_peak,
                         reserved_bytes=f.reserved, reserved_bytes_peak=f.reserved_peak)
        return stats

    def _counters(self):
        return {
            "allocated_bytes": self._allocated, "allocated_bytes_peak": self._allocated_peak,
            "reserved_bytes": self._reserved, "reserved_bytes_peak": self._reserved_peak,
            "active_blocks": self._active, "segments": len(self._segments),
            "allocations": self._allocations, "cache_hits": self._hits,
            "backing_mallocs": self._mallocs, "backing_frees": self._frees,
            "out_of_memory": self._ooms,
        }

    def reset_peak(self, family=False):
        """Peaks restart from the current values (with `family`: of the private pools too)."""
        with self._family.lock:
            for pool in (self._family.pools if family else [self]):
                pool._allocated_peak, pool._reserved_peak = pool._allocated, pool._reserved
            if family:
                f = self._family
                f.allocated_peak, f.reserved_peak = f.allocated, f.reserved

    def summary(self, family=False):
        """A short table of `stats(family)` in MiB."""
        with self._family.lock:
            self._family.drain()
            return self._summary(family)

    def _summary(self, family):
        s = self._stats(family)
        name = "memory pool" if self._family.root() is self else "private memory pool"
        if family and len(self._family.pools) > 1:
            name += f" and its {len(self._family.pools) - 1} private pool(s)"
        limit = self._family.limit
        hits = s["cache_hits"] / s["allocations"] if s["allocations"] else 0.0
        return "\n".join([
            f"cupytp {name}: {s['active_blocks']} live blocks in {s['segments']} segments, "
            f"limit {'none' if limit is None else f'{limit / MiB:.1f} MiB'}",
            f"{'':18}{'current':>12}{'peak':>12}",
            f"{'allocated (MiB)':18}{s['allocated_bytes'] / MiB:12.1f}"
            f"{s['allocated_bytes_peak'] / MiB:12.1f}",
            f"{'reserved (MiB)':18}{s['reserved_bytes'] / MiB:12.1f}"
            f"{s['reserved_bytes_peak'] / MiB:12.1f}",
            f"{s['allocations']} allocations, {hits:.1%} from the cache; backing allocator: "
            f"{s['backing_mallocs']} mallocs, {s['backing_frees']} frees; "
            f"{s['out_of_memory']} out-of-memory errors",
        ])


class CudaMalloc:
    """The backing allocator on a GPU: one cudaMalloc per segment. The handle is CuPy's
    `Memory` object, whose last reference calls cudaFree when the pool drops it."""

    def __init__(self):
        self._memory = backend.xp.cuda.memory.Memory
        self._error = backend.xp.cuda.runtime.CUDARuntimeError

    def malloc(self, nbytes):
        try:
            memory = self._memory(nbytes)
        except self._error as err:
            if err.status != CUDA_ERROR_MEMORY_ALLOCATION:
                raise
            raise MemoryError(f"cudaMalloc of {nbytes} B failed: {err}") from err
        return memory.ptr, memory

    def free(self, handle):
        """Nothing to call: cudaFree runs when the pool drops `handle`, its last reference."""


# ---- the default pool, routing, CuPy ------------------------------------------------------------

class _Routing(threading.local):
    def __init__(self):
        self.pools = []                  # this thread's use_pool() stack


_routing = _Routing()
_default = None                          # the default pool: install() or set_default_pool()
_limit = None                            # set_memory_limit() before a pool exists
_cupy_previous = None                    # CuPy's allocator before install()
_origins = None                          # block address -> (size, where), after record_origins()
_HERE = os.path.abspath(__file__)


class Allocation:
    """A block handed out by `allocate`; finalizing it gives the block back to its pool."""
    __slots__ = ("pool", "block")

    def __init__(self, pool, block):
        self.pool, self.block = pool, block

    def __del__(self):
        _give_back_block(self.pool, self.block)


def _give_back_block(pool, block):
    if _origins is not None:
        _origins.pop(block.address, None)
    pool.free(block)


def record_origins(enabled=True):
    """From now on (until called with False) each allocation remembers where it was asked for:
    the innermost frames outside this module and CuPy. Costs a stack walk per allocation."""
    global _origins
    _origins = {} if enabled else None


def _where(depth=3):
    frames = [f for f in traceback.extract_stack(limit=24)
              if f.filename != _HERE and "/cupy/" not in f.filename
              and "/cupy_backends/" not in f.filename]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                      for f in reversed(frames[-depth:]))


def live_by_origin(top=12):
    """[(bytes, blocks, where)] of the live allocations made since `record_origins()`, the
    places holding the most first."""
    if _origins is None:
        raise RuntimeError("live_by_origin() needs memory.record_origins() before the "
                           "allocations it should explain")
    totals = {}
    for size, where in list(_origins.values()):
        entry = totals.setdefault(where, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(((size, count, where) for where, (size, count) in totals.items()),
                    reverse=True)
    return ranked[:top]


def current_pool():
    """The pool this thread allocates from: the innermost `use_pool`, else the default (None
    when no pool is installed)."""
    pools = _routing.pools
    return pools[-1] if pools else _default


def allocate(nbytes, stream=0):
    """An `Allocation` of `nbytes` on `stream` from the current pool."""
    return Allocation(*_take(nbytes, stream))


def _take(nbytes, stream):
    """(the current pool, a block of `nbytes` on `stream` from it)."""
    pool = current_pool()
    if pool is None:
        _no_pool()
    block = pool.malloc(nbytes, stream)
    if _origins is not None:
        _origins[block.address] = (block.size, _where())
    return pool, block


def _no_pool():
    raise RuntimeError("no memory pool is in use: cupytp.init() installs one on a GPU (unless "
                       "CUPYTP_ALLOCATOR=cupy); on the CPU, use set_default_pool()")


@contextlib.contextmanager
def use_pool(pool):
    """Inside the block this thread allocates from `pool` (blocks nest: the innermost wins).
    Frees always go to the pool a block came from."""
    if not isinstance(pool, CachingAllocator):
        raise TypeError(f"use_pool() takes a CachingAllocator (from new_private_pool()), "
                        f"got {type(pool).__name__}")
    _routing.pools.append(pool)
    try:
        yield pool
    finally:
        _routing.pools.pop()


def default_pool():
    return _default


def set_default_pool(pool):
    """Make `pool` (or None) the default pool; returns the previous one."""
    global _default
    previous, _default = _default, pool
    return previous


def new_private_pool():
    """A private pool sharing the default pool's backing allocator and limit (CUDA graphs)."""
    if _default is None:
        raise RuntimeError("a private pool needs the framework's memory pool, which is not in "
                           "use: call cupytp.init() on a GPU, and leave CUPYTP_ALLOCATOR unset")
    return _default.new_private_pool()


def allocator_choice():
    """CUPYTP_ALLOCATOR: 'cupytp' (the default: this module's pool) or 'cupy' (CuPy's pool)."""
    return env.get("CUPYTP_ALLOCATOR")


def install():
    """Make a CachingAllocator over cudaMalloc on the current device the default pool and CuPy's
    allocator (once; later calls return the same pool). GPU only."""
    global _cupy_previous
    if not backend.on_gpu:
        raise RuntimeError("memory.install() needs a GPU: the NumPy backend has no device "
                           "memory to pool")
    if _cupy_previous is None:
        cupy = backend.xp
        set_default_pool(CachingAllocator(CudaMalloc(), _limit))
        _cupy_previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(_cupy_allocator(cupy, cupy.cuda.Device().id))
    return _default


def uninstall():
    """Give CuPy back the allocator it had before `install()`; arrays already made keep their
    memory until they are dropped."""
    global _cupy_previous
    if _cupy_previous is not None:
        backend.xp.cuda.set_allocator(_cupy_previous)
        _cupy_previous = None
        set_default_pool(None)


def _cupy_allocator(cupy, device_id):
    """CuPy's allocator function: the memory of each array is a block of the current pool on
    the current stream, held by a `PooledMemory` (CuPy's BaseMemory) that gives the block back
    when CuPy drops it: one object per allocation besides CuPy's MemoryPointer. (`allocate`'s
    steps inlined: this runs for every array.)"""
    memory_pointer = cupy.cuda.MemoryPointer
    current_stream = cupy.cuda.get_current_stream
    routing = _routing

    class PooledMemory(cupy.cuda.memory.BaseMemory):
        __slots__ = ("pool", "block")

        def __del__(self):
            if _origins is not None:
                _origins.pop(self.block.address, None)
            self.pool.free(self.block)

    def allocate_for_cupy(nbytes):
        pools = routing.pools
        pool = pools[-1] if pools else _default
        if pool is None:
            _no_pool()
        block = pool.malloc(nbytes, current_stream().ptr)
        if _origins is not None:
            _origins[block.address] = (block.size, _where())
        memory = PooledMemory()
        memory.ptr, memory.size, memory.device_id = block.address, nbytes, device_id
        memory.pool, memory.block = pool, block
        return memory_pointer(memory, 0)

    return allocate_for_cupy


# ---- statistics of the default pool (exported as cupytp.memory_stats() and friends) ------------

def memory_stats():
    """The default pool's `stats` together with its live private pools (keys: STAT_KEYS).
    All zeros when no pool is in use (the NumPy backend, or CUPYTP_ALLOCATOR=cupy)."""
    if _default is None:
        return dict.fromkeys(STAT_KEYS, 0)
    return _default.stats(family=True)


def memory_summary():
    """`summary` of the default pool and its live private pools, or why there is none."""
    if _default is not None:
        return _default.summary(family=True)
    if not backend.on_gpu:
        return "cupytp memory pool: none (the NumPy backend allocates host memory)"
    return ("cupytp memory pool: not in use (cupytp.init() installs it; with "
            "CUPYTP_ALLOCATOR=cupy, CuPy's own pool serves the arrays)")


def reset_peak_memory_stats():
    """Peaks of the default pool and its private pools restart from the current values."""
    if _default is not None:
        _default.reset_peak(family=True)


def set_memory_limit(limit):
    """The most bytes the default pool and its private pools may reserve (None: no limit);
    remembered for a pool installed later."""
    global _limit
    _limit = _check_limit(limit)
    if _default is not None:
        _default.set_memory_limit(_limit)


def empty_cache():
    """Give the default pool's wholly free segments back to the device (private pools keep
    theirs until they are dropped or emptied themselves)."""
    if _default is not None:
        _default.empty_cache()
