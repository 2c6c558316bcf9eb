"""The caching allocator's bookkeeping, driven by a fake backing allocator (fake addresses), held
to hand-worked numbers and to a simple model of live blocks; on a GPU, CuPy arrays from it."""
import gc

import numpy
import pytest

import cupytp
from cupytp import memory
from cupytp.backend import on_gpu, xp
from cupytp.memory import MiB, CachingAllocator, OutOfMemoryError, segment_size, use_pool

requires_gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU and CuPy")
KiB = 1024


class FakeDevice:
    """A backing allocator of fake addresses, 1 MiB apart between segments (so none touch), with
    at most `capacity` bytes out at once; `on_malloc` runs inside each malloc."""

    def __init__(self, capacity=None):
        self.capacity = capacity
        self.next_address = 1 << 32
        self.live = {}                  # address -> size
        self.mallocs = self.frees = 0
        self.on_malloc = None

    def malloc(self, nbytes):
        if self.on_malloc is not None:
            self.on_malloc()
        if self.capacity is not None and sum(self.live.values()) + nbytes > self.capacity:
            raise MemoryError(f"fake device: {nbytes} B do not fit")
        address = self.next_address
        self.next_address += nbytes + MiB
        self.live[address] = nbytes
        self.mallocs += 1
        return address, ("fake", address)

    def free(self, handle):
        del self.live[handle[1]]
        self.frees += 1


@pytest.fixture
def device():
    return FakeDevice()


@pytest.fixture
def pool(device):
    return CachingAllocator(device)


@pytest.fixture
def default_pool(pool):
    previous = memory.set_default_pool(pool)
    yield pool
    memory.set_default_pool(previous)


def test_sizes_round_up_and_choose_their_segment(pool):
    assert [pool.malloc(n).size for n in (0, 1, 512, 513, 4000)] == [512, 512, 512, 1024, 4096]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(10 * MiB + 512) == 12 * MiB


def test_a_freed_size_is_reused_exactly(pool, device):
    a = pool.malloc(4 * KiB, stream=7)
    keep = pool.malloc(512, stream=7)              # a's neighbour stays live: no merge
    pool.free(a)
    again = pool.malloc(4000, stream=7)
    assert again.address == a.address and again.size == 4 * KiB and again.stream == 7
    assert device.mallocs == 1 and pool.stats()["cache_hits"] == 2
    assert keep.address == a.address + 4 * KiB


def test_best_fit_takes_the_smallest_block_that_is_large_enough(pool, device):
    holes = {}
    for size in (8 * KiB, 4 * KiB, 16 * KiB):      # three holes kept apart by live blocks
        holes[size] = pool.malloc(size)
        pool.malloc(512)
    for block in holes.values():
        pool.free(block)
    fit = pool.malloc(3 * KiB)
    assert fit.address == holes[4 * KiB].address and fit.size == 3 * KiB   # 1 KiB split off
    assert pool.malloc(1 * KiB).address == holes[4 * KiB].address + 3 * KiB
    assert pool.malloc(10 * KiB).address == holes[16 * KiB].address
    assert pool.malloc(8 * KiB).address == holes[8 * KiB].address
    assert device.mallocs == 1


def test_split_and_merge_within_a_segment(pool, device):
    a, b, c = (pool.malloc(4 * KiB) for _ in range(3))
    assert (b.address, c.address) == (a.address + 4 * KiB, a.address + 8 * KiB)
    rest = [pool.malloc(MiB), pool.malloc(MiB - 12 * KiB)]     # the segment's rest: none free
    pool.free(b)
    pool.free(a)                                   # a and b wait to merge
    merged = pool.malloc(8 * KiB)                  # no free block is large enough: they merge
    assert merged.address == a.address and merged.size == 8 * KiB
    assert device.mallocs == 1
    for block in (merged, c, *rest):
        pool.free(block)                           # everything merges back: one free segment
    pool.empty_cache()
    assert device.live == {} and pool.stats()["segments"] == 0 and device.mallocs == 1


def test_a_free_block_large_enough_is_split_before_waiting_frees_merge(pool, device):
    a, b, c = (pool.malloc(4 * KiB) for _ in range(3))
    pool.free(b)
    pool.free(a)
    too_big = pool.malloc(12 * KiB)                # the segment's free rest serves it
    assert too_big.address == c.address + 4 * KiB
    assert pool.malloc(4 * KiB).address == a.address      # the last freed size, as it is


def test_a_size_freed_and_asked_again_is_neither_merged_nor_split(pool, device):
    a, b = pool.malloc(4 * KiB), pool.malloc(4 * KiB)
    pool.free(a)
    pool.free(b)                                   # merging waits: both keep their size
    assert [pool.malloc(4 * KiB).address for _ in range(2)] == [b.address, a.address]
    assert pool.stats()["cache_hits"] == 3 and device.mallocs == 1


def test_large_blocks_split_only_when_at_least_1_mib_remains(pool, device):
    big = pool.malloc(19 * MiB + 512 * KiB)        # 20 MiB segment, 0.5 MiB left: not split
    assert big.size == 20 * MiB
    pool.free(big)
    two = pool.malloc(2 * MiB)                     # the cached 20 MiB segment, split
    rest = pool.malloc(18 * MiB)
    assert rest.address == two.address + 2 * MiB and device.mallocs == 1
    assert pool.stats()["allocated_bytes"] == 20 * MiB


def test_oversize_blocks_are_never_split_and_serve_only_requests_near_their_size(pool, device):
    logits = pool.malloc(1024 * MiB)
    pool.free(logits)
    activation = pool.malloc(100 * MiB)            # not carved from the free 1 GiB block
    state = pool.malloc(2 * MiB)
    assert device.mallocs == 3 and activation.address != logits.address
    near = pool.malloc(1024 * MiB - 19 * MiB)      # less than 20 MiB smaller: served, whole
    assert near.address == logits.address and near.size == 1024 * MiB and device.mallocs == 3
    pool.free(near)
    assert pool.malloc(1024 * MiB - 20 * MiB).address != logits.address    # too small for it
    pool.free(activation)
    assert pool.malloc(60 * MiB).address == activation.address   # below 256 MiB: split as any
    big = pool.malloc(300 * MiB)
    pool.free(big)
    assert pool.malloc(290 * MiB).address == big.address and pool.malloc(10 * MiB).address \
        != big.address + 290 * MiB
    assert state.size == 2 * MiB


def test_a_request_just_below_the_oversize_bound_reuses_its_segment(pool, device):
    """255.5 MiB takes a segment of 256 MiB (rounded to 2 MiB): oversize, yet the request it
    was made for, asked again, finds it."""
    for _ in range(3):
        pool.free(pool.malloc(256 * MiB - 512 * KiB))
    assert device.mallocs == 1


def test_steps_with_long_logits_keep_two_logits_segments(pool, device):
    """A long sequence's step: the logits and their gradient (oversize), activations made
    after them, the optimizer's states made at the end of the first step. Carved up, a freed
    logits block would be pinned by them and the step would need a third; whole, two serve."""
    def step(states):
        saved = [pool.malloc(60 * MiB) for _ in range(4)]          # block inputs kept
        logits = pool.malloc(2048 * MiB)
        grad = pool.malloc(2048 * MiB)
        pool.free(logits)
        pool.free(grad)
        for block in saved:                        # backward: recomputed activations
            work = [pool.malloc(200 * MiB), pool.malloc(500 * MiB)]
            pool.free(block)
            for w in work:
                pool.free(w)
        if not states:
            states.extend(pool.malloc(100 * MiB) for _ in range(2))
    states = []
    for _ in range(2):
        step(states)
    settled = (device.mallocs, pool.stats()["reserved_bytes"])
    for _ in range(3):
        step(states)
    assert (device.mallocs, pool.stats()["reserved_bytes"]) == settled
    assert 2 * 2048 * MiB < pool.stats()["reserved_bytes"] < 3 * 2048 * MiB


def test_small_and_large_blocks_never_share_a_segment(pool, device):
    large = pool.malloc(3 * MiB)
    small = pool.malloc(4 * KiB)
    assert device.mallocs == 2
    assert not large.address <= small.address < large.address + 20 * MiB


def test_a_block_freed_on_one_stream_is_not_given_to_another(pool, device):
    a = pool.malloc(4 * KiB, stream=1)
    pool.free(a)
    b = pool.malloc(4 * KiB, stream=2)
    assert b.stream == 2 and device.mallocs == 2
    start, end = device_range(device, a.address)
    assert not start <= b.address < end
    assert pool.malloc(4 * KiB, stream=1).address == a.address


def device_range(device, address):
    start = max(s for s in device.live if s <= address)
    return start, start + device.live[start]


def test_statistics_after_a_scripted_sequence(pool):
    a = pool.malloc(1000)                          # 1 KiB from a new 2 MiB segment
    b = pool.malloc(3 * MiB)                       # from a new 20 MiB segment
    c = pool.malloc(1000)                          # cache hit (the small segment's rest)
    pool.free(a)
    d = pool.malloc(600)                           # cache hit: a's 1 KiB, exactly
    assert d.address == a.address
    pool.free(b)
    expected = {
        "allocated_bytes": 2 * KiB, "allocated_bytes_peak": 3 * MiB + 2 * KiB,
        "reserved_bytes": 22 * MiB, "reserved_bytes_peak": 22 * MiB, "active_blocks": 2,
        "segments": 2, "allocations": 4, "cache_hits": 2, "backing_mallocs": 2,
        "backing_frees": 0, "out_of_memory": 0}
    assert pool.stats() == expected
    pool.empty_cache()                             # the large segment is wholly free
    expected.update(reserved_bytes=2 * MiB, segments=1, backing_frees=1)
    assert pool.stats() == expected
    pool.reset_peak()
    expected.update(allocated_bytes_peak=2 * KiB, reserved_bytes_peak=2 * MiB)
    assert pool.stats() == expected
    summary = pool.summary()
    assert "allocated (MiB)" in summary and "reserved (MiB)" in summary
    assert "2 live blocks in 1 segments" in summary and "4 allocations, 50.0% from the cache" \
        in summary
    pool.free(c)
    pool.free(d)
    assert pool.stats()["allocated_bytes"] == 0 and pool.stats()["active_blocks"] == 0


def test_limit_releases_cached_segments_first(device):
    pool = CachingAllocator(device, limit=21 * MiB)
    pool.free(pool.malloc(4 * KiB))                # a cached, wholly free 2 MiB segment
    large = pool.malloc(5 * MiB)                   # 2 + 20 MiB > 21 MiB: the cache goes first
    assert large.size == 5 * MiB and list(device.live.values()) == [20 * MiB]
    assert pool.stats()["backing_frees"] == 1 and pool.stats()["reserved_bytes"] == 20 * MiB


def test_limit_raises_out_of_memory_with_the_summary_and_leaks_nothing(device):
    pool = CachingAllocator(device, limit=3 * MiB)
    a = pool.malloc(MiB)
    b = pool.malloc(MiB)                           # the rest of the 2 MiB segment
    before, live = pool.stats(), dict(device.live)
    with pytest.raises(OutOfMemoryError) as caught:
        pool.malloc(512)                           # another 2 MiB segment would make 4 MiB
    assert isinstance(caught.value, MemoryError)
    message = str(caught.value)
    assert "past the limit of 3145728 B" in message and pool.summary() in message
    assert pool.stats() == dict(before, out_of_memory=1) and device.live == live
    pool.set_memory_limit(None)
    pool.free(a)
    pool.free(b)
    mallocs = device.mallocs
    assert pool.malloc(512).address in (a.address, b.address) and device.mallocs == mallocs


def test_backing_failure_empties_the_cache_and_retries(device):
    device.capacity = 21 * MiB
    pool = CachingAllocator(device)
    pool.free(pool.malloc(4 * KiB))
    assert pool.malloc(5 * MiB).size == 5 * MiB    # failed once, cache emptied, retried
    assert device.frees == 1 and pool.stats()["out_of_memory"] == 0
    with pytest.raises(OutOfMemoryError) as caught:
        pool.malloc(16 * MiB)                      # 20 + 16 MiB: no room even uncached
    assert isinstance(caught.value.__cause__, MemoryError)
    assert "no free 16777216 B segment" in str(caught.value)
    assert "1 out-of-memory errors" in str(caught.value)


def test_empty_cache_returns_only_wholly_free_segments(pool, device):
    used = pool.malloc(4 * KiB)
    partly = pool.malloc(4 * KiB)
    pool.free(partly)                              # its segment still holds `used`
    pool.free(pool.malloc(12 * MiB))               # a wholly free 12 MiB segment
    pool.free(pool.malloc(4 * KiB, stream=3))      # and a wholly free 2 MiB one on stream 3
    pool.empty_cache()
    assert list(device.live.items()) == [(device_range(device, used.address)[0], 2 * MiB)]
    assert pool.stats()["backing_frees"] == 2 and pool.stats()["reserved_bytes"] == 2 * MiB


def test_private_pools_are_isolated_and_use_pool_nests(default_pool, device):
    first, second = memory.new_private_pool(), memory.new_private_pool()
    assert memory.current_pool() is default_pool
    with use_pool(first):
        assert memory.current_pool() is first
        with use_pool(second):
            assert memory.current_pool() is second
            inner = memory.allocate(4 * KiB)
        assert memory.current_pool() is first
        outer = memory.allocate(8 * KiB)
    assert memory.current_pool() is default_pool
    assert (inner.pool, outer.pool) == (second, first)
    assert first.stats()["allocated_bytes"] == 8 * KiB
    assert second.stats()["allocated_bytes"] == 4 * KiB
    assert default_pool.stats()["allocated_bytes"] == 0 and device.mallocs == 2
    stats = memory.memory_stats()                  # the default pool with its private pools
    assert stats["allocated_bytes"] == 12 * KiB and stats["reserved_bytes"] == 4 * MiB
    assert stats["allocations"] == 2 and stats["segments"] == 2
    assert "and its 2 private pool(s)" in memory.memory_summary()
    address = outer.block.address
    del outer                                      # back to `first`, not the default pool
    assert first.stats()["allocated_bytes"] == 0
    assert memory.allocate(8 * KiB).block.address != address     # the default pool's own
    with use_pool(first):
        assert memory.allocate(8 * KiB).block.address == address


def test_a_block_freed_while_another_pool_is_in_use_returns_to_its_own(default_pool):
    private = memory.new_private_pool()
    with use_pool(private):
        allocation = memory.allocate(4 * KiB)
    with use_pool(memory.new_private_pool()) as other:
        del allocation
        assert other.stats()["allocated_bytes"] == 0 and other.stats()["segments"] == 0
    assert private.stats()["allocated_bytes"] == 0 and private.stats()["active_blocks"] == 0
    assert private.stats()["segments"] == 1 and default_pool.stats()["segments"] == 0


def test_a_private_pool_keeps_its_memory_until_dropped(default_pool, device):
    private = memory.new_private_pool()
    private.free(private.malloc(4 * KiB))
    memory.empty_cache()                           # the default pool's cache only
    assert len(device.live) == 1
    assert memory.memory_stats()["reserved_bytes"] == 2 * MiB
    del private
    gc.collect()
    assert device.live == {} and memory.memory_stats()["reserved_bytes"] == 0
    assert memory.memory_stats()["reserved_bytes_peak"] == 2 * MiB
    memory.reset_peak_memory_stats()
    assert memory.memory_stats()["reserved_bytes_peak"] == 0


def test_a_free_during_an_allocation_waits_for_it(pool, device):
    """A finalizer that the garbage collector runs inside malloc frees into the busy pool."""
    victim = pool.malloc(4 * KiB)
    device.on_malloc = lambda: pool.free(victim)
    large = pool.malloc(3 * MiB)                   # a new segment: on_malloc runs inside
    stats = pool.stats()
    assert stats["active_blocks"] == 1 and stats["allocated_bytes"] == large.size


def test_bad_input_is_one_clear_error(pool, default_pool, monkeypatch):
    with pytest.raises(ValueError, match="negative number of bytes"):
        pool.malloc(-1)
    block = pool.malloc(512)
    pool.free(block)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(block)
    with pytest.raises(TypeError, match="use_pool\\(\\) takes a CachingAllocator"):
        with use_pool(object()):
            pass
    with pytest.raises(ValueError, match="memory limit must be a number of bytes"):
        pool.set_memory_limit(-5)
    monkeypatch.setenv("CUPYTP_ALLOCATOR", "torch")
    with pytest.raises(ValueError, match="CUPYTP_ALLOCATOR='torch' is not understood"):
        memory.allocator_choice()
    monkeypatch.setenv("CUPYTP_ALLOCATOR", "cupy")
    assert memory.allocator_choice() == "cupy"
    memory.set_default_pool(None)
    with pytest.raises(RuntimeError, match="no memory pool is in use"):
        memory.allocate(512)
    with pytest.raises(RuntimeError, match="a private pool needs the framework's memory pool"):
        memory.new_private_pool()


@pytest.mark.skipif(on_gpu, reason="the NumPy backend's answers")
def test_top_level_functions_work_without_a_pool():
    assert memory.default_pool() is None
    assert set(cupytp.memory_stats()) == set(memory.STAT_KEYS)
    assert not any(cupytp.memory_stats().values())
    assert "NumPy backend" in cupytp.memory_summary()
    cupytp.reset_peak_memory_stats()
    cupytp.empty_cache()
    cupytp.set_memory_limit(2 ** 30)
    cupytp.set_memory_limit(None)


def test_random_operations_against_a_model():
    """2000 random allocations and frees on three streams: live blocks never overlap, each lies
    in a segment of its stream, and the statistics are the sums of the model."""
    rng = numpy.random.default_rng(0)
    device = FakeDevice()
    pool = CachingAllocator(device)
    live = {}                                      # block -> (requested bytes, stream)
    segment_stream = {}                            # segment address -> stream
    allocations = 0
    for step in range(2000):
        if live and rng.random() < 0.45:
            block = list(live)[rng.integers(len(live))]
            del live[block]
            pool.free(block)
        else:
            kind = rng.random()
            nbytes = int(rng.integers(0, 64 * KiB) if kind < 0.6 else
                         rng.integers(64 * KiB, 4 * MiB) if kind < 0.9 else
                         rng.integers(4 * MiB, 24 * MiB) if kind < 0.98 else
                         rng.integers(200 * MiB, 400 * MiB))
            stream = int(rng.integers(3))
            block = pool.malloc(nbytes, stream)
            allocations += 1
            assert block.size >= nbytes and block.size % 512 == 0 and block.stream == stream
            live[block] = (nbytes, stream)
        if step % 97 == 0:
            pool.empty_cache()
        spans = sorted((b.address, b.address + b.size) for b in live)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        for block, (_, stream) in live.items():
            start, end = device_range(device, block.address)
            assert block.address + block.size <= end
            assert segment_stream.setdefault(start, stream) == stream
        segment_stream = {a: s for a, s in segment_stream.items() if a in device.live}
        stats = pool.stats()
        assert stats["allocated_bytes"] == sum(b.size for b in live)
        assert stats["active_blocks"] == len(live) and stats["allocations"] == allocations
        assert stats["reserved_bytes"] == sum(device.live.values())
        assert stats["segments"] == len(device.live)
        assert stats["backing_mallocs"] == device.mallocs
        assert stats["backing_frees"] == device.frees
    assert stats["cache_hits"] > allocations / 2
    for block in live:
        pool.free(block)
    pool.empty_cache()
    assert device.live == {} and pool.stats()["allocated_bytes"] == 0


# ---- GPU: CuPy arrays from the pool --------------------------------------------------------------

@pytest.mark.gpu
@requires_gpu
def test_cupy_arrays_come_from_the_installed_pool():
    pool = memory.install()
    assert memory.install() is pool and memory.default_pool() is pool
    before = pool.stats()
    array = xp.empty(1000, dtype=xp.float32)                     # 4000 B -> a 4 KiB block
    during = pool.stats()
    assert during["allocated_bytes"] - before["allocated_bytes"] == 4 * KiB
    assert during["allocations"] == before["allocations"] + 1
    assert during["active_blocks"] == before["active_blocks"] + 1
    del array
    after = pool.stats()
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["active_blocks"] == before["active_blocks"]
    again = xp.empty(1000, dtype=xp.float32)
    assert pool.stats()["cache_hits"] == after["cache_hits"] + 1
    assert pool.stats()["backing_mallocs"] == after["backing_mallocs"]
    del again


@pytest.mark.gpu
@requires_gpu
def test_an_array_survives_while_referenced():
    memory.install()
    base = xp.arange(1 << 20, dtype=xp.float32)
    view = base[::2]
    del base                                       # the view keeps the block allocated
    others = [xp.full(1 << 19, 7.0, dtype=xp.float32) for _ in range(4)]
    assert bool((view == xp.arange(0, 1 << 20, 2, dtype=xp.float32)).all())
    assert all(bool((o == 7.0).all()) for o in others)


@pytest.mark.gpu
@requires_gpu
def test_the_limit_applies_to_cupy_arrays():
    pool = memory.install()
    pool.empty_cache()              # no free segment left by earlier tests serves the request
    pool.set_memory_limit(pool.stats()["reserved_bytes"] + 40 * MiB)
    try:
        with pytest.raises(OutOfMemoryError, match="past the limit"):
            xp.empty(64 * MiB, dtype=xp.uint8)
    finally:
        pool.set_memory_limit(None)


def test_live_memory_is_summed_by_where_it_was_allocated(default_pool):
    """With record_origins() each live block is charged to the code that asked for it; freed
    blocks drop out; without it the report is a clear error."""
    memory.record_origins()
    try:
        def parameters():
            return [memory.allocate(3000) for _ in range(2)]

        def activation():
            return memory.allocate(5000)
        kept, temporary = parameters(), activation()
        rows = memory.live_by_origin()
        assert [(size, count) for size, count, _ in rows] == [(6144, 2), (5120, 1)]
        assert "parameters" in rows[0][2] and "activation" in rows[1][2]
        del temporary
        assert [row[:2] for row in memory.live_by_origin()] == [(6144, 2)]
        del kept
        assert memory.live_by_origin() == []
    finally:
        memory.record_origins(False)
    with pytest.raises(RuntimeError, match="record_origins"):
        memory.live_by_origin()
