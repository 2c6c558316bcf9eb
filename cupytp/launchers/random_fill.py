"""Random fills of a rank's block of a global tensor from Philox counters (`philox.Counters`):
`random_fill.cu` where the counters' base lives on the device, the NumPy twin otherwise.

`uniform(counters, dtype)` → uniforms in [0, 1) of the block, `normal(counters, dtype, std)` →
Normal(0, std) values: drawn in float64 (`philox.uniform_at`, `philox.normal_at`), scaled by
std, rounded once to `dtype`. The kernels draw the twin's uniforms bit for bit, and normals to
a few float64 ulps (CUDA's log1p and cos against the C library's).
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import ceil_div, dtype_suffix, get_kernel, is_device_array, multiprocessors
from cupytp.launchers.philox import normal_at, uniform_at

THREADS = 256
BLOCKS_PER_SM = 16      # at most this many blocks per multiprocessor; the threads stride on


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
    return uniform_at(counters.seed, counters.indices()).astype(dtype)


def normal_numpy(counters, dtype=numpy.float64, std=1.0):
    """Twin of `normal`."""
    return (normal_at(counters.seed, counters.indices()) * std).astype(dtype)
