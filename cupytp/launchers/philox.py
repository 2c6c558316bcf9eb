"""Philox-4x32-10 keyed by a seed, one counter per element: the NumPy twin of `philox.cuh`, and
the counters of a draw over a rank's block of a global tensor (`Counters`), which the kernels
that draw (`random_fill`, `dropout`, `flash_attention`) take.

Element i (row-major global index) of a draw gets the counter base + add + i, `base` a 0-d
uint64 device array that CUDA-graph replays rewrite (see `cupytp.tensor.random`). A uniform in
[0, 1) is the 53-bit integer of the first two words of its Philox output over 2^53; a normal is
Box-Muller over the two uniforms of the four words. Dropout draws eight elements per Philox
call: the element of counter P reads 16-bit half P mod 8 of the draw at P - P mod 8 (the low or
high half of word (P mod 8) / 2) and is kept iff that half >= ceil(p 2^16) (`dropout_keeps`; p
counts in steps of 2^-16); draws start at a multiple of DROPOUT_GROUP = 8
(`cupytp.tensor.random`), so one call serves eight global neighbours. The twins compute with the module of their
arrays (CuPy's or NumPy's: on a GPU the NumPy twin runs on host arrays).
"""
import functools
import math
from typing import NamedTuple

import numpy

from cupytp import backend
from cupytp.launchers import is_device_array

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF
MAX_DIMS = 4        # merged block dimensions the kernels take
DROPOUT_GROUP = 8   # dropout's decisions per Philox call: draws start at multiples of it


def philox4x32(counter_lo, counter_hi, key):
    """Four uint32 words per counter (counter as two uint32 arrays, key a 64-bit int)."""
    xp = backend.array_module(counter_lo)
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


def words(seed, counter):
    """The four Philox words of uint64 `counter`s."""
    xp = backend.array_module(counter)
    return philox4x32(counter & xp.uint64(_MASK32), counter >> xp.uint64(32), seed)


def uniform53(a, b):
    """A float64 in [0, 1) from two uint32 words."""
    xp = backend.array_module(a)
    return ((a >> xp.uint64(5)).astype(xp.float64) * 67108864.0
            + (b >> xp.uint64(6)).astype(xp.float64)) / 9007199254740992.0


def uniform_at(seed, counter):
    """float64 uniforms in [0, 1) at uint64 `counter`s (the first two words of each)."""
    a, b, _, _ = words(seed, counter)
    return uniform53(a, b)


def normal_at(seed, counter):
    """float64 standard normals at uint64 `counter`s: Box-Muller over the uniforms of words
    (0, 1) and (2, 3)."""
    xp = backend.array_module(counter)
    a, b, c, d = words(seed, counter)
    u1, u2 = uniform53(a, b), uniform53(c, d)
    return xp.sqrt(-2.0 * xp.log1p(-u1)) * xp.cos(2.0 * numpy.pi * u2)


def keep_threshold(p):
    """The integer t with (16-bit half >= t) == (half / 2¹⁶ >= p), exactly."""
    return math.ceil(p * 2.0 ** 16)


def dropout_keeps(seed, counter, p):
    """Whether dropout with probability p keeps the elements of uint64 `counter`s: half
    counter mod 8 of the draw at counter - counter mod 8 is >= keep_threshold(p)."""
    xp = backend.array_module(counter)
    w = words(seed, counter & ~xp.uint64(DROPOUT_GROUP - 1))
    k = counter & xp.uint64(DROPOUT_GROUP - 1)
    pair = k >> xp.uint64(1)
    word = xp.where(pair == 0, w[0], xp.where(pair == 1, w[1], xp.where(pair == 2, w[2], w[3])))
    half = (word >> (xp.uint64(16) * (k & xp.uint64(1)))) & xp.uint64(0xFFFF)
    return half >= xp.uint64(keep_threshold(p))


def global_indices(shape, offsets, local_shape, xp=None):
    """Row-major global linear index of every element of a local block (a uint64 array of `xp`,
    the backend's by default)."""
    xp = xp or backend.xp
    index = xp.zeros(local_shape, dtype=xp.uint64)
    stride = 1
    for dim in reversed(range(len(shape))):
        axis = xp.arange(offsets[dim], offsets[dim] + local_shape[dim], dtype=xp.uint64)
        view = [1] * len(shape)
        view[dim] = local_shape[dim]
        index = index + axis.reshape(view) * xp.uint64(stride)
        stride *= shape[dim]
    return index


@functools.lru_cache(maxsize=1024)
def merged_block(shape, offsets, local_shape):
    """(global index of the block's first element, [(local extent, global stride)] of its
    dimensions merged where the block is contiguous in the global tensor too, outermost
    first): the block's local row-major index l maps to first + sum_d i_d stride_d. Tuples in,
    worked out once per block."""
    first, stride, dims = 0, 1, []
    for n, total, offset in zip(reversed(local_shape), reversed(shape), reversed(offsets)):
        first += offset * stride
        if n != 1:
            if dims and dims[-1][0] * dims[-1][1] == stride:
                dims[-1][0] *= n            # the inner dims cover all of this one's stride
            else:
                dims.append([n, stride])
        stride *= total
    return first, tuple(tuple(d) for d in reversed(dims)) or ((1, 1),)


class Counters(NamedTuple):
    """The counters of one draw over a rank's block: element i (row-major global index) of the
    global `shape` gets base + add + i, keyed by `seed`; the block is `local_shape` at
    `offsets`."""
    seed: int
    base: object        # 0-d uint64 array (device memory on a GPU)
    add: int
    shape: tuple
    offsets: tuple
    local_shape: tuple

    def indices(self):
        """The block's counters (uint64, local_shape): the twins draw with these."""
        xp = backend.array_module(self.base)
        return global_indices(self.shape, self.offsets, self.local_shape, xp) + \
            (self.base + xp.uint64(self.add))

    def arguments(self):
        """The kernels' draw parameters (`PHILOX_BLOCK_PARAMS` of philox.cuh): seed, base, add
        (plus the block's first global index), the number of merged dimensions, their inner
        extents and all their global strides, padded to MAX_DIMS."""
        first, dims = merged_block(self.shape, self.offsets, self.local_shape)
        if len(dims) > MAX_DIMS:
            raise ValueError(f"a draw over a block {self.local_shape} at {self.offsets} of "
                             f"{self.shape} is split along {len(dims)} runs of dimensions; the "
                             f"kernels take at most {MAX_DIMS}: redistribute the tensor so that "
                             "fewer of its dimensions are sharded")
        padded = [(1, 0)] * (MAX_DIMS - len(dims)) + list(dims)
        extents = [numpy.int64(n) for n, _ in padded[1:]]
        strides = [numpy.int64(s) for _, s in padded]
        return (numpy.uint64(self.seed), self.base, numpy.uint64(self.add + first),
                numpy.int32(len(dims)), *extents, *strides)
