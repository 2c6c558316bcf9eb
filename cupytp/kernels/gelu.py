"""Tanh-form GeLU (GPT-2's) and its gradient: `gelu.cu` for CuPy arrays, a NumPy twin otherwise.

    y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

computed in float32 for float32/bfloat16/float16 and in float64 for float64; results have the
input's dtype and shape.
"""
import math

import numpy

from cupytp.backend import xp
from cupytp.kernels import ceil_div, check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.kernels import is_device_array

THREADS = 256
MAX_BLOCKS = 32768  # the kernels' grid-stride loops cover larger arrays
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
CUBIC = 0.044715


def gelu(x):
    """GeLU of x, a new array."""
    if not is_device_array(x):
        return gelu_numpy(x)
    _check(x=x)
    y = xp.empty_like(x)
    _launch("gelu_forward", x, y)
    return y


def gelu_backward(x, dy):
    """dL/dx of y = gelu(x) given dL/dy, a new array."""
    if not is_device_array(x):
        return gelu_backward_numpy(x, dy)
    _check(x=x, dy=dy)
    dx = xp.empty_like(x)
    _launch("gelu_backward", x, dy, dx)
    return dx


def _check(**arrays):
    dtypes = check_lists(**{name: [array] for name, array in arrays.items()})
    dtype_suffix(dtypes["x"])
    for name, dtype in dtypes.items():
        if dtype != dtypes["x"]:
            raise ValueError(f"{name} has dtype {dtype} but x has {dtypes['x']}")


def _launch(name, x, *arrays):
    n = x.size
    if n == 0:
        return
    kernel = get_kernel("gelu.cu", f"{name}_{dtype_suffix(x.dtype)}")
    blocks = min(ceil_div(n, THREADS), MAX_BLOCKS)
    kernel((blocks,), (THREADS,), (x, *arrays, numpy.int64(n)))


def _tanh_arg(x):
    return SQRT_2_OVER_PI * (x + CUBIC * x * x * x)


def gelu_numpy(x):
    """NumPy twin of `gelu`."""
    _check(x=x)
    xc = x.astype(compute_dtype(x.dtype))
    y = 0.5 * xc * (1 + numpy.tanh(_tanh_arg(xc)))
    return y.astype(x.dtype)


def gelu_backward_numpy(x, dy):
    """NumPy twin of `gelu_backward`."""
    _check(x=x, dy=dy)
    compute = compute_dtype(x.dtype)
    xc = x.astype(compute)
    t = numpy.tanh(_tanh_arg(xc))
    du_dx = SQRT_2_OVER_PI * (1 + 3 * CUBIC * xc * xc)
    grad = 0.5 * (1 + t) + 0.5 * xc * (1 - t * t) * du_dx
    return (dy.astype(compute) * grad).astype(x.dtype)
