"""Converting copies between float dtypes, `cast.cu` for CuPy arrays, a NumPy twin otherwise.

`converted(array, dtype)`: a new array, `array.astype(dtype)`; `assign(dst, src, add=False)`:
dst[...] = src (or +=) converted; both through the kernel where it applies.

`cast_rows(dst, src, add=False)`: dst[...] = src converted to dst's dtype (dst += src with
`add`, summed in the compute dtype and rounded once), for 1-D or 2-D arrays of one shape whose
rows are contiguous (any row pitch: a block of columns of a wider array). Four elements per
thread with vector loads and stores where every row start allows it: a strided bf16 <-> fp32
copy at memory bandwidth, where CuPy's elementwise copy indexes every element.
"""
import functools
import math

import numpy

from cupytp.backend import c_contiguous, xp
from cupytp.launchers import (
    ceil_div, compute_dtype, dtype_suffix, get_kernel, is_device_array, vector_width)

THREADS = 256
MAX_BLOCKS = 32768     # the grid-stride loop covers larger arrays
VECTOR = 4
PAIRS = {("f32", "bf16"), ("bf16", "f32"), ("f32", "f16"), ("f16", "f32"), ("f32", "f32"),
         ("bf16", "bf16"), ("f64", "f64")}


def _rows(array):
    """(pitch in elements, rows, cols) of a 1-D or 2-D array with contiguous rows, else None."""
    if array.ndim == 1:
        return (array.size, 1, array.size) if array.strides[0] == array.itemsize else None
    if array.ndim != 2 or (array.shape[1] > 1 and array.strides[1] != array.itemsize) or \
            array.strides[0] % array.itemsize:
        return None
    return array.strides[0] // array.itemsize, array.shape[0], array.shape[1]


def applies(dst, src):
    """True when the kernel takes these arrays: one shape, 1-D or 2-D with contiguous rows, a
    dtype pair it is built for."""
    try:
        pair = (dtype_suffix(src.dtype), dtype_suffix(dst.dtype))
    except ValueError:
        return False
    return (pair in PAIRS and dst.shape == src.shape and _rows(dst) is not None
            and _rows(src) is not None)


def assign(dst, src, add=False):
    """dst[...] = src (dst += src with `add`) converted to dst's dtype: through the kernel where
    it applies, by an elementwise copy otherwise."""
    if applies(dst, src):
        cast_rows(dst, src, add)
    elif add:
        dst += src
    else:
        dst[...] = src


def converted(array, dtype):
    """`array.astype(dtype)` (a new array); a C-contiguous CuPy array of a pair the kernel is
    built for goes through it."""
    if not (is_device_array(array) and c_contiguous(array)):
        with numpy.errstate(over="ignore"):     # out-of-range values become inf, as on GPUs
            return array.astype(dtype)
    out = xp.empty(array.shape, dtype)
    flat = _flat_launch(array.size, array.dtype, out.dtype,
                        array.data.ptr % (VECTOR * array.itemsize) == 0)
    if flat is None:
        assign(out.reshape(-1), array.reshape(-1))
    else:
        kernel, grid, pitch, rows = flat
        kernel(grid, (THREADS,), (array, pitch, out, pitch, pitch, rows, numpy.int32(0)))
    return out


@functools.lru_cache(maxsize=1024)
def _flat_launch(size, src_dtype, dst_dtype, aligned):
    """(kernel, grid, pitch, rows) of `cast_rows` over `size` contiguous elements as one row
    (`aligned`: the source's address allows vectors; the new destination's always does), or
    None for a pair the kernel is not built for or no elements."""
    try:
        pair = (dtype_suffix(src_dtype), dtype_suffix(dst_dtype))
    except ValueError:
        return None
    if pair not in PAIRS or not size:
        return None
    vec = VECTOR if aligned and size % VECTOR == 0 else 1
    grid = (min(ceil_div(size // vec, THREADS), MAX_BLOCKS),)
    return (get_kernel("cast.cu", f"cast_rows_{pair[0]}_{pair[1]}_v{vec}"), grid,
            numpy.int64(size), numpy.int64(1))


def cast_rows(dst, src, add=False):
    if not applies(dst, src):
        raise ValueError(f"cast_rows takes 1-D or 2-D arrays of one shape with contiguous rows "
                         f"and a float dtype pair among {sorted(PAIRS)}, got dst {dst.dtype} "
                         f"{dst.shape} {dst.strides}, src {src.dtype} {src.shape} {src.strides}")
    if not is_device_array(dst):
        cast_rows_numpy(dst, src, add)
        return
    if not dst.size:
        return
    (dst_pitch, rows, cols), (src_pitch, _, _) = _rows(dst), _rows(src)
    vec = vector_width(VECTOR, math.gcd(cols, dst_pitch, src_pitch), (dst, src))
    name = f"cast_rows_{dtype_suffix(src.dtype)}_{dtype_suffix(dst.dtype)}_v{vec}"
    work = rows * (cols // vec)
    get_kernel("cast.cu", name)(
        (min(ceil_div(work, THREADS), MAX_BLOCKS),), (THREADS,),
        (src, numpy.int64(src_pitch), dst, numpy.int64(dst_pitch), numpy.int64(cols),
         numpy.int64(rows), numpy.int32(bool(add))))


def cast_rows_numpy(dst, src, add=False):
    """NumPy twin: the value (or the sum, in the compute dtype of the wider side) rounded once."""
    if add:
        compute = max(compute_dtype(dst.dtype), compute_dtype(src.dtype),
                      key=lambda d: d.itemsize)
        dst[...] = (dst.astype(compute) + src.astype(compute)).astype(dst.dtype)
    else:
        dst[...] = src.astype(dst.dtype)
