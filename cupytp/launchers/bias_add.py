"""A bias along the last dimension, in one pass: `bias_add.cu` for CuPy arrays, NumPy twins
otherwise.

`bias_add(x, bias)` → x + bias, a new array like x: x C-contiguous, bias (cols,) of x's dtype;
the sum taken in the compute dtype and rounded once (what x + bias gives in NumPy and CuPy),
without the broadcast indexing of a generic elementwise kernel.

`bias_residual_add(x, bias, residual)` → residual + (x + bias), a new array of the compute dtype
(a row-parallel layer's 16-bit output, its fp32 bias and the fp32 residual stream in one pass,
where adding the bias and then the residual would write and read x + bias once more).
`applies` and `residual_applies` say whether the kernels take the arrays.
"""
import numpy

from cupytp.backend import c_contiguous, xp
from cupytp.launchers import (
    compute_dtype, dtype_suffix, get_kernel, has_kernel, is_device_array, rows_grid, vector_width)

VECTOR_BYTES = 16       # each thread moves 16 bytes of x per row where alignment allows


def applies(x, bias):
    """True for a contiguous x of 2 or more dimensions and a bias (x.shape[-1],) of its dtype."""
    return (bias.ndim == 1 and x.ndim >= 2 and bias.shape[0] == x.shape[-1]
            and x.dtype == bias.dtype and has_kernel(x.dtype)
            and c_contiguous(x) and c_contiguous(bias))


def residual_applies(x, bias, residual):
    """True for a contiguous x of 2 or more dimensions, a bias (x.shape[-1],) and a contiguous
    residual of x's shape, both of x's compute dtype."""
    return (has_kernel(x.dtype) and bias.ndim == 1 and x.ndim >= 2
            and bias.shape[0] == x.shape[-1] and residual.shape == x.shape
            and bias.dtype == residual.dtype == compute_dtype(x.dtype)
            and c_contiguous(x) and c_contiguous(bias)
            and c_contiguous(residual))


def bias_add(x, bias):
    if not applies(x, bias):
        raise ValueError(f"bias_add takes a C-contiguous x of 2+ dimensions and a bias of shape "
                         f"{x.shape[-1:]} and x's dtype, got x {x.dtype} {x.shape}, bias "
                         f"{bias.dtype} {bias.shape}")
    if not is_device_array(x):
        return bias_add_numpy(x, bias)
    y = xp.empty_like(x)
    _launch("bias_add", x, (x, bias, y))
    return y


def bias_residual_add(x, bias, residual):
    if not residual_applies(x, bias, residual):
        raise ValueError(f"bias_residual_add takes a C-contiguous x of 2+ dimensions, a bias of "
                         f"shape {x.shape[-1:]} and a C-contiguous residual of x's shape, both "
                         f"of dtype {compute_dtype(x.dtype)}; got x {x.dtype} {x.shape}, bias "
                         f"{bias.dtype} {bias.shape}, residual {residual.dtype} "
                         f"{residual.shape}")
    if not is_device_array(x):
        return bias_residual_add_numpy(x, bias, residual)
    out = xp.empty_like(residual)
    _launch("bias_residual_add", x, (x, bias, residual, out))
    return out


def _launch(name, x, arrays):
    cols = x.shape[-1]
    rows = x.size // cols if cols else 0
    if rows == 0 or cols == 0:
        return
    vec = vector_width(VECTOR_BYTES // x.itemsize, cols, arrays)
    grid, block = rows_grid(rows, cols // vec)
    kernel = get_kernel("bias_add.cu", f"{name}_{dtype_suffix(x.dtype)}_v{vec}")
    kernel(grid, block, (*arrays, numpy.int64(rows), numpy.int32(cols)))


def bias_add_numpy(x, bias):
    """NumPy twin: the sum in the compute dtype, rounded once."""
    compute = compute_dtype(x.dtype)
    return (x.astype(compute) + bias.astype(compute)).astype(x.dtype)


def bias_residual_add_numpy(x, bias, residual):
    """NumPy twin: residual + (x + bias) in the compute dtype."""
    return residual + (x.astype(compute_dtype(x.dtype)) + bias)
