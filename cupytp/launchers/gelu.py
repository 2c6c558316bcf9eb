"""Tanh-form GeLU (GPT-2's) and its gradient: `gelu.cu` for CuPy arrays, a NumPy twin otherwise.

    y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

computed in float32 for float32/bfloat16/float16 and in float64 for float64; results have the
input's dtype and shape. `bias_gelu(x, bias)` = gelu(x + bias) with bias (cols,) along x's last
dimension (cast to the compute dtype), and its backward gives dx and the bias gradient (the column
sum of dx in the compute dtype) from one pass; `gelu_backward(x, dy, sums=True)` gives those
column sums too (for a bias a product's epilogue added: x is then the pre-activation).
"""
import math

import numpy

from cupytp.backend import xp
from cupytp.launchers import ceil_div, check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.launchers import is_device_array, rows_grid, vector_width
from cupytp.launchers.column_sum import NULL, column_sum

THREADS = 256
MAX_BLOCKS = 32768  # the kernels' grid-stride loops cover larger arrays
VECTOR_BYTES = 16  # each thread moves 16 bytes of x at a time where alignment allows
ROWS_PER_THREAD = 16  # bias_gelu: rows per thread (fewer block rows: fewer partial bias sums)
MAX_ROW_BLOCKS = 1024  # bias_gelu: block rows (partial bias sums); more rows per thread beyond
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


def gelu_backward(x, dy, sums=False):
    """dL/dx of y = gelu(x) given dL/dy, a new array; with `sums`, (dx, its column sums over x's
    last dimension in the compute dtype, summed before rounding), from the same pass."""
    if sums:
        return bias_gelu_backward(x, None, dy)
    if not is_device_array(x):
        return gelu_backward_numpy(x, dy)
    _check(x=x, dy=dy)
    dx = xp.empty_like(x)
    _launch("gelu_backward", x, dy, dx)
    return dx


def bias_gelu(x, bias):
    """gelu(x + bias), a new array; bias (cols,) along x's last dimension."""
    if not is_device_array(x):
        return bias_gelu_numpy(x, bias)
    bias = _check_bias(x, bias)
    y = xp.empty_like(x)
    if x.size:
        vec, grid, block = _rows_launch(x, bias, y)
        get_kernel("gelu.cu", f"bias_gelu_forward_{dtype_suffix(x.dtype)}_v{vec}")(
            grid, block, (x, bias, y, *_rows_and_cols(x)))
    return y


def bias_gelu_backward(x, bias, dy):
    """(dx, dbias) of y = bias_gelu(x, bias) given dy: dx like x, dbias (cols,) in the compute
    dtype. bias None: gelu(x)'s, with dx's column sums."""
    if not is_device_array(x):
        return bias_gelu_backward_numpy(x, bias, dy)
    compute = compute_dtype(x.dtype)
    bias = _check_sums(x, bias, dy)
    dx = xp.empty_like(x)
    if not x.size:
        return dx, xp.zeros(x.shape[-1:], dtype=compute)
    vec, grid, block = _rows_launch(x, *[a for a in (bias, dy, dx) if a is not None])
    partials = xp.empty((grid[1], x.shape[-1]), dtype=compute)
    get_kernel("gelu.cu", f"bias_gelu_backward_{dtype_suffix(x.dtype)}_v{vec}")(
        grid, block, (x, NULL if bias is None else bias, dy, dx, partials,
                      *_rows_and_cols(x)))
    return dx, column_sum(partials)


def _check_sums(x, bias, dy):
    """The bias (None: none) in the compute dtype, after checking every array."""
    if bias is not None:
        return _check_bias(x, bias, dy=dy)
    _check(x=x, dy=dy)
    if x.ndim == 0:
        raise ValueError("gelu_backward: column sums need x of at least one dimension")
    return None


def _check_bias(x, bias, **arrays):
    """The bias in the compute dtype, after checking every array."""
    _check(x=x, **arrays)
    check_lists(bias=[bias])
    if x.ndim == 0 or bias.shape != x.shape[-1:]:
        raise ValueError(f"bias_gelu: bias must have shape {x.shape[-1:]} (x's last dimension), "
                         f"got {bias.shape}")
    return bias.astype(compute_dtype(x.dtype), copy=False)


def _rows_and_cols(x):
    cols = x.shape[-1]
    return numpy.int64(x.size // cols), numpy.int32(cols)


def _rows_launch(x, *arrays):
    """(vector width, grid, block) of a bias_gelu kernel over x and `arrays`."""
    cols = x.shape[-1]
    vec = vector_width(VECTOR_BYTES // x.itemsize, cols, (x,) + arrays)
    return (vec,) + rows_grid(x.size // cols, cols // vec, THREADS, ROWS_PER_THREAD,
                              MAX_ROW_BLOCKS)


def _check(**arrays):
    dtypes = check_lists(**{name: [array] for name, array in arrays.items()})
    dtype_suffix(dtypes["x"])
    for name, dtype in dtypes.items():
        if dtype != dtypes["x"]:
            raise ValueError(f"{name} has dtype {dtype} but x has {dtypes['x']}")


def _launch(name, x, *arrays):
    """A gelu kernel over n contiguous elements, in vectors of 16 bytes where every array's start
    is aligned for them."""
    n = x.size
    if n == 0:
        return
    vec = vector_width(VECTOR_BYTES // x.itemsize, VECTOR_BYTES // x.itemsize, (x,) + arrays)
    kernel = get_kernel("gelu.cu", f"{name}_{dtype_suffix(x.dtype)}_v{vec}")
    blocks = min(ceil_div(ceil_div(n, vec), THREADS), MAX_BLOCKS)
    kernel((blocks,), (THREADS,), (x, *arrays, numpy.int64(n)))


def _tanh_arg(x):
    return SQRT_2_OVER_PI * (x + CUBIC * x * x * x)


def _gelu_value(x):
    return 0.5 * x * (1 + numpy.tanh(_tanh_arg(x)))


def _gelu_slope(x):
    t = numpy.tanh(_tanh_arg(x))
    du_dx = SQRT_2_OVER_PI * (1 + 3 * CUBIC * x * x)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du_dx


def gelu_numpy(x):
    """NumPy twin of `gelu`."""
    _check(x=x)
    return _gelu_value(x.astype(compute_dtype(x.dtype))).astype(x.dtype)


def gelu_backward_numpy(x, dy):
    """NumPy twin of `gelu_backward`."""
    _check(x=x, dy=dy)
    compute = compute_dtype(x.dtype)
    return (dy.astype(compute) * _gelu_slope(x.astype(compute))).astype(x.dtype)


def bias_gelu_numpy(x, bias):
    """NumPy twin of `bias_gelu`."""
    bias = _check_bias(x, bias)
    return _gelu_value(x.astype(bias.dtype) + bias).astype(x.dtype)


def bias_gelu_backward_numpy(x, bias, dy):
    """NumPy twin of `bias_gelu_backward`."""
    compute = compute_dtype(x.dtype)
    bias = _check_sums(x, bias, dy)
    xc = x.astype(compute)
    d = dy.astype(compute) * _gelu_slope(xc if bias is None else xc + bias)
    return d.astype(x.dtype), d.sum(axis=tuple(range(x.ndim - 1)))
