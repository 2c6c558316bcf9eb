"""Embedding lookup and gradient over this rank's rows of a table: `embedding.cu` for CuPy arrays,
NumPy twins otherwise.

`embedding_forward(ids, weight, offset=0)` → out (ids.shape + (cols,)): row ids - offset of
`weight` (rows, cols), zeros where that is outside [0, rows) (an id another rank's part of a
vocab-parallel table holds). One launch.

`embedding_backward(ids, g, rows, offset=0, into=None)` → grad (rows, cols): the rows of g
(ids.shape + (cols,)) summed into the rows their ids - offset name; ids outside add nothing.
Accumulated in float32 (float64 for float64), returned in g's dtype; or added into `into`, a
contiguous (rows, cols) array of that compute dtype (a tied table's gradient from its other use),
and `into` returned. On the GPU the sum is atomicAdd: one launch,
no temporary storage. A deterministic sum would first sort the ids (a Thrust sort through CuPy,
with its own temporary allocations inside the step) and then add each run of equal ids in order,
one run per block, which serializes frequent tokens. The price of atomics: repeated ids may add
in a different order from run to run (the last bits of a float32 sum).

ids are int64 and C-contiguous, as are weight and g.
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.launchers import is_device_array

THREADS = 256


def embedding_forward(ids, weight, offset=0):
    """weight's rows at ids - offset (zeros outside); a new array of weight's dtype."""
    if not is_device_array(weight):
        return embedding_forward_numpy(ids, weight, offset)
    _check("embedding_forward", ids, weight, ids.shape)
    out = xp.empty(ids.shape + weight.shape[1:], dtype=weight.dtype)
    if ids.size and weight.shape[1]:
        get_kernel("embedding.cu", f"embedding_forward_{dtype_suffix(weight.dtype)}")(
            (ids.size,), (THREADS,), (ids, weight, out, numpy.int32(weight.shape[1]),
                                      numpy.int64(offset), numpy.int64(weight.shape[0])))
    return out


def embedding_backward(ids, g, rows, offset=0, into=None):
    """d loss / d table (rows, cols) from d loss / d output g; a new array of g's dtype, or
    added into `into` (module docstring)."""
    if not is_device_array(g):
        return embedding_backward_numpy(ids, g, rows, offset, into)
    compute = _check("embedding_backward", ids, g, g.shape[:-1])
    grad = xp.zeros((rows, g.shape[-1]), dtype=compute) if into is None else \
        _sum_target(into, (rows, g.shape[-1]), compute, xp.ndarray)
    if ids.size and g.shape[-1]:
        kernel = get_kernel("embedding.cu", f"embedding_backward_{dtype_suffix(g.dtype)}")
        kernel((ids.size,), (THREADS,), (ids, g, grad, numpy.int32(g.shape[-1]),
                                         numpy.int64(offset), numpy.int64(rows)))
    return grad if into is not None else grad.astype(g.dtype, copy=False)


def _sum_target(into, shape, compute, kind):
    if type(into) is not kind or into.shape != shape or into.dtype != compute or \
            not into.flags.c_contiguous:
        raise ValueError(f"embedding_backward: the gradient to add into must be a contiguous "
                         f"{compute} {kind.__name__} of shape {shape}, got {type(into).__name__} "
                         f"{getattr(into, 'dtype', None)} {getattr(into, 'shape', None)}")
    return into


def _check(name, ids, values, ids_shape):
    """The compute dtype of `values` (the table, or g), after checking both arrays; ids must
    have `ids_shape`."""
    check_lists(ids=[ids])
    dtype = check_lists(values=[values])["values"]
    dtype_suffix(dtype)
    if ids.dtype != numpy.int64 or ids.shape != ids_shape:
        raise ValueError(f"{name}: ids must be int64 of shape {ids_shape}, got {ids.dtype} "
                         f"{ids.shape}")
    if values.ndim < 1 or (name == "embedding_forward" and values.ndim != 2):
        raise ValueError(f"{name}: the table must be (rows, cols), got shape {values.shape}")
    return compute_dtype(dtype)


def _local_rows(ids, offset, rows):
    """(ids - offset, where those are rows of this table)."""
    local = ids - offset
    return local, (local >= 0) & (local < rows)


def embedding_forward_numpy(ids, weight, offset=0):
    """NumPy twin of `embedding_forward`."""
    _check("embedding_forward", ids, weight, ids.shape)
    local, valid = _local_rows(ids, offset, weight.shape[0])
    out = numpy.zeros(ids.shape + weight.shape[1:], dtype=weight.dtype)
    out[valid] = weight[local[valid]]
    return out


def embedding_backward_numpy(ids, g, rows, offset=0, into=None):
    """NumPy twin of `embedding_backward`."""
    compute = _check("embedding_backward", ids, g, g.shape[:-1])
    grad = numpy.zeros((rows, g.shape[-1]), dtype=compute) if into is None else \
        _sum_target(into, (rows, g.shape[-1]), compute, numpy.ndarray)
    local, valid = _local_rows(ids, offset, rows)
    numpy.add.at(grad, local[valid], g[valid].astype(compute))
    return grad if into is not None else grad.astype(g.dtype, copy=False)
