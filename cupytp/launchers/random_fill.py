"""Random fills of a rank's block of a global tensor from Philox counters (`philox.Counters`):
`random_fill.cu` where the counters' base lives on the device, the NumPy twin otherwise.

`uniform(counters, dtype)` → uniforms in [0, 1) of the block, `normal(counters, dtype, std)` →
Normal(0, std) values: drawn in float64 (`philox.uniform_at`, `philox.normal_at`), scaled by
std, rounded once to `dtype`. The kernels draw the twin's uniforms bit for bit, and normals to
a few float64 ulps (CUDA's log1p and cos against the C library's).
"""
import math

import numpy

from cupytp.backend import xp
from cupytp.launchers import ceil_div, dtype_suffix, get_kernel, is_device_array, multiprocessors
from cupytp.launchers.philox import normal_at, uniform_at

THREADS = 256
BLOCKS_PER_SM = 16      # at most this many blocks per multiprocessor; the threads stride on
CHUNK_ELEMENTS = 1 << 18     # elements the twins draw at a time


def uniform(counters, dtype=numpy.float64):
    if not is_device_array(counters.base):
        return uniform_numpy(counters, dtype)
    return _fill("random_uniform", counters, dtype, 1.0)


def normal(counters, dtype=numpy.float64, std=1.0):
    if not is_device_array(counters.base):
        return normal_numpy(counters, dtype, std)
    return _fill("random_normal", counters, dtype, std)


def _fill(name, counters, dtype, std):
    out = xp.empty(counters.local_shape, dtype=dtype)
    if out.size:
        grid = min(ceil_div(out.size, THREADS), BLOCKS_PER_SM * multiprocessors())
        kernel = get_kernel("random_fill.cu", f"{name}_{dtype_suffix(dtype)}")
        kernel((grid,), (THREADS,), (out, numpy.int64(out.size), float(std),
                                     *counters.arguments()))
    return out


def uniform_numpy(counters, dtype=numpy.float64):
    """Twin of `uniform`."""
    return _fill_numpy(counters, dtype, lambda c: uniform_at(c.seed, c.indices()))


def normal_numpy(counters, dtype=numpy.float64, std=1.0):
    """Twin of `normal`."""
    return _fill_numpy(counters, dtype, lambda c: normal_at(c.seed, c.indices()) * std)


def _fill_numpy(counters, dtype, draw, chunk=CHUNK_ELEMENTS):
    """`draw(counters)` rounded to `dtype`, made a few rows of the block at a time: the array
    chain's uint64 and float64 temporaries take ~100 bytes an element, so drawn whole a
    large embedding would take gigabytes."""
    shape, offsets = counters.local_shape, counters.offsets
    if not shape:
        return draw(counters).astype(dtype)
    out = numpy.empty(shape, dtype=dtype)
    rows = max(1, chunk // max(1, math.prod(shape[1:])))
    for start in range(0, shape[0], rows):
        stop = min(start + rows, shape[0])
        part = counters._replace(offsets=(offsets[0] + start,) + tuple(offsets[1:]),
                                 local_shape=(stop - start,) + tuple(shape[1:]))
        out[start:stop] = draw(part)
    return out
