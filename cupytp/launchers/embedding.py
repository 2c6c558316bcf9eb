"""Embedding gradient: `embedding.cu` for CuPy arrays, a NumPy twin (`numpy.add.at`) otherwise.

`embedding_backward(ids, g, rows)` → grad (rows, cols): the rows of g (ids.shape + (cols,))
summed into the rows their ids name; ids outside [0, rows) add nothing. Accumulated in float32
(float64 for float64), returned in g's dtype. On the GPU the sum is atomicAdd: one launch, no
temporary storage. A deterministic sum would first sort the ids (a Thrust sort through CuPy, with
its own temporary allocations inside the step) and then add each run of equal ids in order, one
run per block, which serializes frequent tokens. The price of atomics: repeated ids may add in a
different order from run to run (the last bits of a float32 sum).
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.launchers import is_device_array

THREADS = 256


def embedding_backward(ids, g, rows):
    """d loss / d table (rows, cols) from d loss / d output g; a new array of g's dtype."""
    if not is_device_array(g):
        return embedding_backward_numpy(ids, g, rows)
    compute = _check(ids, g)
    grad = xp.zeros((rows, g.shape[-1]), dtype=compute)
    if ids.size and g.shape[-1]:
        kernel = get_kernel("embedding.cu", f"embedding_backward_{dtype_suffix(g.dtype)}")
        kernel((ids.size,), (THREADS,), (ids, g, grad, numpy.int32(g.shape[-1]),
                                         numpy.int64(rows)))
    return grad.astype(g.dtype, copy=False)


def _check(ids, g):
    """The compute dtype, after checking both arrays."""
    check_lists(ids=[ids])
    dtype = check_lists(g=[g])["g"]
    dtype_suffix(dtype)
    if ids.dtype != numpy.int64 or g.shape[:-1] != ids.shape:
        raise ValueError(f"embedding_backward: ids must be int64 of shape {g.shape[:-1]} (g's "
                         f"leading dimensions), got {ids.dtype} {ids.shape}")
    return compute_dtype(dtype)


def embedding_backward_numpy(ids, g, rows):
    """NumPy twin of `embedding_backward`."""
    compute = _check(ids, g)
    grad = numpy.zeros((rows, g.shape[-1]), dtype=compute)
    valid = (ids >= 0) & (ids < rows)
    numpy.add.at(grad, ids[valid], g[valid].astype(compute))
    return grad.astype(g.dtype, copy=False)
