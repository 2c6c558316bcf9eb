"""Counter-based random numbers that do not depend on how a tensor is sharded.

Philox-4x32-10 keyed by the seed, with the global element index (plus the generator's running
offset) as the counter: element (i, j) of a global tensor gets the same value whatever the mesh,
the placements or the number of ranks. Every draw advances the offset by the global element
count, identically on all ranks. The same array code runs on NumPy and CuPy.

Inside a captured CUDA graph the offset cannot be a constant of the graph: draws made while
capturing count from a device-resident base that is rewritten before every replay (see
`cupytp.graph`), so each replay draws fresh numbers, the same ones an eager run would draw.
"""
import numpy

from cupytp import backend, graph

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def philox4x32(counter_lo, counter_hi, key):
    """Four uint32 words per counter (counter as two uint32 arrays, key a 64-bit int)."""
    xp = backend.xp
    u64 = xp.uint64
    c0 = counter_lo.astype(u64)
    c1 = counter_hi.astype(u64)
    c2 = xp.zeros_like(c0)
    c3 = xp.zeros_like(c0)
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    for _ in range(10):
        p0 = c0 * u64(_M0)
        p1 = c2 * u64(_M1)
        hi0, lo0 = p0 >> u64(32), p0 & u64(_MASK32)
        hi1, lo1 = p1 >> u64(32), p1 & u64(_MASK32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ u64(k0), lo1, hi0 ^ c3 ^ u64(k1), lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def _uniform53(a, b):
    """A float64 in [0, 1) from two uint32 words."""
    xp = backend.xp
    return ((a >> xp.uint64(5)).astype(xp.float64) * 67108864.0
            + (b >> xp.uint64(6)).astype(xp.float64)) / 9007199254740992.0


def uniform_at(seed, counter):
    """float64 uniforms in [0, 1) at uint64 `counter`s: the first two Philox words of each, as
    `Generator.uniform` draws them (for twins of kernels that draw their own numbers)."""
    xp = backend.xp
    a, b, _, _ = philox4x32(counter & xp.uint64(_MASK32), counter >> xp.uint64(32), seed)
    return _uniform53(a, b)


def global_indices(shape, offsets, local_shape):
    """Row-major global linear index of every element of a local block (uint64 array)."""
    xp = backend.xp
    index = xp.zeros(local_shape, dtype=xp.uint64)
    stride = 1
    for dim in reversed(range(len(shape))):
        axis = xp.arange(offsets[dim], offsets[dim] + local_shape[dim], dtype=xp.uint64)
        view = [1] * len(shape)
        view[dim] = local_shape[dim]
        index = index + axis.reshape(view) * xp.uint64(stride)
        stride *= shape[dim]
    return index


class Generator(graph.GraphState):
    """A seed and a running offset; each draw reserves the counters of one global tensor."""

    def __init__(self, seed=0):
        self._bases = None           # device uint64 (2,): [0] = 0, the base of eager draws;
        self.manual_seed(seed)       # [1] the base of captured draws, set before each replay

    def manual_seed(self, seed):
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.offset = 0
        return self

    def get_state(self):
        return (self.seed, self.offset)

    def set_state(self, state):
        self.seed, self.offset = int(state[0]), int(state[1])

    def philox_args(self, count):
        """Reserve `count` counters: (seed, base, add), the counters being base + add + i for
        i < count, with `base` a 0-d uint64 device array (zero outside a CUDA-graph capture,
        rewritten before each replay inside one) for kernels that read it from memory."""
        if self._bases is None:      # made once, best before any capture (a warm-up step)
            self._bases = backend.xp.zeros(2, dtype=backend.xp.uint64)
        record = graph.join(self)
        if record is not None:
            base, add = self._bases[1], self.offset - record["start"]
        else:
            base, add = self._bases[0], self.offset
        self.offset += count
        return self.seed, base, add

    # ---- CUDA-graph state (cupytp.graph.GraphState) ---------------------------------------------
    def capture_begin(self, record):
        record["start"], record["seed"] = self.offset, self.seed

    def capture_end(self, record):
        record["per_replay"] = self.offset - record["start"]
        self.offset = record["start"]

    def before_replay(self, record):
        if self.seed != record["seed"]:
            raise graph.GraphCaptureError("the generator was reseeded after a CUDA graph captured "
                                          "draws from it: capture the step again")
        self._bases[1:].fill(backend.xp.uint64(self.offset))
        self.offset += record["per_replay"]

    def _words(self, shape, offsets, local_shape):
        count = int(numpy.prod(shape, dtype=numpy.int64))
        seed, base, add = self.philox_args(count)
        counter = global_indices(shape, offsets, local_shape) + (base + backend.xp.uint64(add))
        return philox4x32(counter & backend.xp.uint64(_MASK32), counter >> backend.xp.uint64(32),
                          seed)

    def uniform(self, shape, offsets, local_shape):
        """float64 uniforms in [0, 1) for the block `local_shape` at `offsets` of `shape`."""
        a, b, _, _ = self._words(shape, offsets, local_shape)
        return _uniform53(a, b)

    def normal(self, shape, offsets, local_shape):
        """float64 standard normals (Box-Muller) for the block at `offsets` of `shape`."""
        xp = backend.xp
        a, b, c, d = self._words(shape, offsets, local_shape)
        u1, u2 = _uniform53(a, b), _uniform53(c, d)
        return xp.sqrt(-2.0 * xp.log1p(-u1)) * xp.cos(2.0 * numpy.pi * u2)


default_generator = Generator(0)


def manual_seed(seed):
    """Seed the default generator (same seed on every rank gives the same global tensors)."""
    return default_generator.manual_seed(seed)
