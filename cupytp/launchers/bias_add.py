"""x + bias along x's last dimension: `bias_add.cu` for CuPy arrays, a NumPy twin otherwise.

`bias_add(x, bias)` → a new array like x: x C-contiguous, bias (cols,) of x's dtype; the sum is
taken in the compute dtype and rounded once (what x + bias gives in NumPy and CuPy), in one pass
without the broadcast indexing of a generic elementwise kernel. `applies(x, bias)` says whether
the kernel takes these arrays.
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import (
    ceil_div, compute_dtype, dtype_suffix, get_kernel, has_kernel, is_device_array)

THREADS = 256
MAX_BLOCKS = 32768     # the grid-stride loop covers larger arrays


def applies(x, bias):
    """True for a contiguous x of 2 or more dimensions and a bias (x.shape[-1],) of its dtype."""
    return (bias.ndim == 1 and x.ndim >= 2 and bias.shape[0] == x.shape[-1]
            and x.dtype == bias.dtype and has_kernel(x.dtype)
            and x.flags.c_contiguous and bias.flags.c_contiguous)


def bias_add(x, bias):
    if not applies(x, bias):
        raise ValueError(f"bias_add takes a C-contiguous x of 2+ dimensions and a bias of shape "
                         f"{x.shape[-1:]} and x's dtype, got x {x.dtype} {x.shape}, bias "
                         f"{bias.dtype} {bias.shape}")
    if not is_device_array(x):
        return bias_add_numpy(x, bias)
    y = xp.empty_like(x)
    if x.size:
        kernel = get_kernel("bias_add.cu", f"bias_add_{dtype_suffix(x.dtype)}")
        kernel((min(ceil_div(x.size, THREADS), MAX_BLOCKS),), (THREADS,),
               (x, bias, y, numpy.int64(x.size), numpy.int32(x.shape[-1])))
    return y


def bias_add_numpy(x, bias):
    """NumPy twin: the sum in the compute dtype, rounded once."""
    compute = compute_dtype(x.dtype)
    return (x.astype(compute) + bias.astype(compute)).astype(x.dtype)
