"""Sums over every dimension but the last (bias and LayerNorm-weight gradients):
`column_sum.cu` for CuPy arrays, a NumPy twin otherwise.

`column_sum(x, y=None, dtype=None)` → (cols,): sum over the leading dimensions of x (of x * y when
y is given: x's shape, in the compute dtype), accumulated in the compute dtype (float32 for 16-bit
and float32 inputs, float64 for float64) and returned in `dtype` (x's by default). Deterministic: a
fixed grid of partial sums, then one pass over them.

`column_sum_and_cast(x, cast, dtype=None, mask=None, p=0.0)` → (the sums, x converted to
`cast`): a float32 x's column sums and its bf16 or fp16 copy (rounded as `cast.converted`
rounds) from one read of x (an output gradient's cast for the products and its bias's
gradient); with a dropout mask, of x dropped out as `dropout.dropout_backward` does (the
gradient of a dropped-out product).
"""
import functools
import math

import numpy

from cupytp.backend import c_contiguous, xp
from cupytp.launchers import ceil_div, compute_dtype, dtype_suffix, get_kernel, is_device_array
from cupytp.launchers.dropout import dropout_backward_numpy

LANES = 32               # blockDim.x: column vectors per block
ROW_LANES = 8            # blockDim.y: rows summed side by side, then across the block
ROWS_PER_THREAD = 16     # rows each thread sums (the first pass), up to ...
MAX_ROW_BLOCKS = 64      # ... this many block rows (partial sums per column); more rows beyond
VECTOR_BYTES = 16        # each thread loads 16 bytes per row where alignment allows
NULL = numpy.uint64(0)


class _Plan:
    """How column sums of one signature of operands launch (checked and worked out once): the
    first pass's kernels with vectors (None where cols do not allow them) and without, the byte
    alignment the vectors need, the finishing pass's, and the sizes."""
    __slots__ = ("rows", "cols", "out_dtype", "compute", "row_blocks", "first", "finish")

    def __init__(self, shape, x_dtype, dtype, cast=None):
        self.cols = shape[-1] if shape else 1
        self.rows = math.prod(shape) // self.cols if self.cols else 0
        self.compute = compute_dtype(x_dtype)
        self.out_dtype = self.compute if dtype != x_dtype else x_dtype
        self.row_blocks = max(1, min(ceil_div(self.rows, ROW_LANES * ROWS_PER_THREAD),
                                     MAX_ROW_BLOCKS))
        suffix = dtype_suffix(x_dtype)
        one_pass = self.row_blocks == 1     # the one row of partial sums is the result, ...
        kernel = "column_sum_direct" if one_pass and self.out_dtype != self.compute else \
            "column_sum"                    # ... rounded to x's dtype
        first = f"{kernel}_{suffix}" if cast is None else \
            f"column_sum_cast_{suffix}_{dtype_suffix(cast)}"     # (a float32 x, float32 sums)
        self.first = self._forms("column_sum.cu", first, x_dtype)
        finish = f"column_sum_finish_{suffix}" if self.out_dtype == x_dtype else \
            f"column_sum_{dtype_suffix(self.compute)}"
        self.finish = None if one_pass else self._forms("column_sum.cu", finish, self.compute)

    def _forms(self, cu_file, name, dtype):
        """(the kernel with vectors or None, the byte alignment they need, the elements per
        vector, the kernel without vectors)."""
        vec = VECTOR_BYTES // numpy.dtype(dtype).itemsize
        vectors = None if self.cols % vec else get_kernel(cu_file, f"{name}_v{vec}")
        return vectors, vec * self.compute.itemsize, vec, get_kernel(cu_file, f"{name}_v1")

    @staticmethod
    def launch(forms, cols, arrays, args):
        """Run one pass: with vectors when every array is aligned for them."""
        vectors, alignment, vec, plain = forms
        pointers = 0
        for array in arrays:
            pointers |= array.data.ptr
        if vectors is None or pointers % alignment:
            vectors, vec = plain, 1
        vectors((ceil_div(cols // vec, LANES), args[0]), (LANES, ROW_LANES), args[1:])


def _signature(array):
    return None if array is None else (array.shape, array.dtype, c_contiguous(array))


@functools.lru_cache(maxsize=256)
def _plan(x, y, dtype, cast=None):
    _check(x, y)
    if cast is not None and (x[1] != numpy.float32 or y is not None
                             or dtype_suffix(cast) not in ("bf16", "f16")):
        raise ValueError(f"column_sum_and_cast takes a float32 x to bf16 or fp16, got {x[1]} to "
                         f"{cast}")
    return _Plan(x[0], x[1], dtype, cast)


def column_sum(x, y=None, dtype=None):
    dtype = numpy.dtype(dtype or x.dtype)
    if not is_device_array(x):
        return column_sum_numpy(x, y, dtype)
    return _sums(_plan(_signature(x), _signature(y), dtype), x, y, dtype)


def column_sum_and_cast(x, cast, dtype=None, mask=None, p=0.0):
    """(column_sum(x, dtype=dtype), x converted to `cast`) from one read of x (float32, cast
    bf16 or fp16). With a dropout `mask` of probability p (`dropout.dropout`'s, over x's
    elements), x is first `dropout_backward`'s x * (bit ? 1/(1-p) : 0)."""
    dtype, cast = numpy.dtype(dtype or x.dtype), numpy.dtype(cast)
    if mask is not None and mask.shape != (ceil_div(x.size, 8),):
        raise ValueError(f"column_sum_and_cast: the mask must hold {ceil_div(x.size, 8)} bytes "
                         f"(one bit per element), got {mask.shape}")
    if not is_device_array(x):
        dropped = x if mask is None else dropout_backward_numpy(x, mask, p)
        copy = _cast_numpy(dropped, cast)
        return column_sum_numpy(dropped, dtype=dtype), copy
    plan = _plan(_signature(x), None, x.dtype, cast)
    copy = xp.empty(x.shape, cast)
    dropout = (NULL if mask is None else mask, numpy.float32(1 / (1 - p)))
    return _sums(plan, x, None, dtype, copy, dropout), copy


def _cast_numpy(x, cast):
    if x.dtype != numpy.float32 or dtype_suffix(cast) not in ("bf16", "f16"):
        raise ValueError(f"column_sum_and_cast takes a float32 x to bf16 or fp16, got {x.dtype} "
                         f"to {cast}")
    with numpy.errstate(over="ignore"):     # out-of-range values become inf, as on GPUs
        return x.astype(cast)


def _sums(plan, x, y, dtype, copy=None, dropout=None):
    """The column sums of x (times y) in `dtype` by `plan`'s passes; the first also writes x's
    `copy` where the plan casts, x first dropped out by `dropout` (mask or NULL, scale)."""
    rows, cols = plan.rows, plan.cols
    out = xp.empty((cols,), dtype=plan.out_dtype)
    if cols == 0:
        return out.astype(dtype, copy=False)
    if rows == 0:
        out[...] = 0
        return out.astype(dtype, copy=False)
    operands = (x,) if y is None else (x, y)
    partials = out if plan.finish is None else xp.empty((plan.row_blocks, cols), plan.compute)
    args = (plan.row_blocks, x, NULL if y is None else y, partials, numpy.int64(rows),
            numpy.int32(cols))
    plan.launch(plan.first, cols, operands + (partials,) + (() if copy is None else (copy,)),
                args if copy is None else args + (copy,) + dropout)
    if plan.finish is not None:
        plan.launch(plan.finish, cols, (partials, out),
                    (1, partials, NULL, out, numpy.int64(plan.row_blocks), numpy.int32(cols)))
    return out.astype(dtype, copy=False)


def column_sum_numpy(x, y=None, dtype=None):
    """NumPy twin: the product (if any) and the sum in the compute dtype, one rounding at the
    end."""
    _check(_signature(x), _signature(y))
    compute = compute_dtype(x.dtype)
    v = x.astype(compute, copy=False)
    if y is not None:
        v = v * y.astype(compute)
    v = v.reshape(-1, x.shape[-1] if x.ndim else 1)
    return v.sum(axis=0).astype(dtype or x.dtype)


def _check(x, y):
    """x and y signatures ((shape, dtype, C-contiguous) or None) that column_sum takes."""
    for name, signature in (("x", x), ("y", y)):
        if signature is not None and not signature[2]:
            raise ValueError(f"column_sum: {name} is not C-contiguous")
    dtype_suffix(x[1])
    if y is not None and (y[1] != compute_dtype(x[1]) or y[0] != x[0]):
        raise ValueError(f"column_sum: y must have x's shape {x[0]} and the compute dtype "
                         f"{compute_dtype(x[1])}, got {y[0]} {y[1]}")
