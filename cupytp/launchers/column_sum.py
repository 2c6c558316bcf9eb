"""Sums over every dimension but the last (bias and LayerNorm-weight gradients):
`column_sum.cu` for CuPy arrays, a NumPy twin otherwise.

`column_sum(x, y=None, dtype=None)` → (cols,): sum over the leading dimensions of x (of x * y when
y is given: x's shape, in the compute dtype), accumulated in the compute dtype (float32 for 16-bit
and float32 inputs, float64 for float64) and returned in `dtype` (x's by default). Deterministic: a
fixed grid of partial sums, then one pass over them.
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import ceil_div, check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.launchers import is_device_array, vector_width

LANES = 32               # blockDim.x: column vectors per block
ROW_LANES = 8            # blockDim.y: rows summed side by side, then across the block
ROWS_PER_THREAD = 16     # rows each thread sums (the first pass), up to ...
MAX_ROW_BLOCKS = 64      # ... this many block rows (partial sums per column); more rows beyond
VECTOR_BYTES = 16        # each thread loads 16 bytes per row where alignment allows
NULL = numpy.uint64(0)


def column_sum(x, y=None, dtype=None):
    dtype = numpy.dtype(dtype or x.dtype)
    if not is_device_array(x):
        return column_sum_numpy(x, y, dtype)
    _check(x, y)
    cols = x.shape[-1] if x.ndim else 1
    rows = x.size // cols if cols else 0
    compute = compute_dtype(x.dtype)
    out = xp.empty((cols,), dtype=compute if dtype != x.dtype else x.dtype)
    if cols == 0:
        return out.astype(dtype, copy=False)
    if rows == 0:
        out[...] = 0
        return out.astype(dtype, copy=False)
    suffix = dtype_suffix(x.dtype)
    operands = (x,) if y is None else (x, y)
    vec = vector_width(VECTOR_BYTES // x.itemsize, cols, operands)
    row_blocks = max(1, min(ceil_div(rows, ROW_LANES * ROWS_PER_THREAD), MAX_ROW_BLOCKS))
    one_pass = row_blocks == 1          # the one row of partial sums is the result, ...
    partials = out if one_pass else xp.empty((row_blocks, cols), dtype=compute)
    kernel = "column_sum_direct" if one_pass and out.dtype != compute else "column_sum"
    get_kernel("column_sum.cu", f"{kernel}_{suffix}_v{vec}")(        # ... rounded to x's dtype
        (ceil_div(cols // vec, LANES), row_blocks), (LANES, ROW_LANES),
        (x, NULL if y is None else y, partials, numpy.int64(rows), numpy.int32(cols)))
    if one_pass:
        return out.astype(dtype, copy=False)
    vec = vector_width(VECTOR_BYTES // partials.itemsize, cols, (partials, out))
    finish = f"column_sum_finish_{suffix}" if out.dtype == x.dtype else \
        f"column_sum_{dtype_suffix(compute)}"
    get_kernel("column_sum.cu", f"{finish}_v{vec}")(
        (ceil_div(cols // vec, LANES), 1), (LANES, ROW_LANES),
        (partials, NULL, out, numpy.int64(row_blocks), numpy.int32(cols)))
    return out.astype(dtype, copy=False)


def column_sum_numpy(x, y=None, dtype=None):
    """NumPy twin: the product (if any) and the sum in the compute dtype, one rounding at the
    end."""
    _check(x, y)
    compute = compute_dtype(x.dtype)
    v = x.astype(compute)
    if y is not None:
        v = v * y.astype(compute)
    v = v.reshape(-1, x.shape[-1] if x.ndim else 1)
    return v.sum(axis=0).astype(dtype or x.dtype)


def _check(x, y):
    check_lists(x=[x])
    if y is not None:
        check_lists(y=[y])
    dtype_suffix(x.dtype)
    if y is not None and (y.dtype != compute_dtype(x.dtype) or y.shape != x.shape):
        raise ValueError(f"column_sum: y must have x's shape {x.shape} and the compute dtype "
                         f"{compute_dtype(x.dtype)}, got {y.shape} {y.dtype}")
