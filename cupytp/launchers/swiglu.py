"""The SiLU gate of a SwiGLU MLP: `swiglu.cu` for CuPy arrays, a NumPy twin otherwise.

h (..., 2, F) holds each row's gate g = h[..., 0, :] and up projection u = h[..., 1, :] (the
output of one gate|up product), C-contiguous. `swiglu(h)` → y (..., F) = silu(g) · u;
`swiglu_backward(h, dy, recompute=False)` → dh (..., 2, F) = (dy · u · silu'(g), dy · silu(g)),
or (dh, y) with `recompute=True` (y made again in the same pass, for the next product's weight
gradient). Computed in float32 (float64 for float64), rounded once to h's dtype.
"""
import math

import numpy

from cupytp.backend import xp
from cupytp.launchers import ceil_div, check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.launchers import is_device_array

THREADS = 256
MAX_BLOCKS = 32768      # the kernels' grid-stride loops cover larger arrays
VECTOR_BYTES = 16
NULL = numpy.uint64(0)


def swiglu(h):
    cols = _check(h)
    if not is_device_array(h):
        return swiglu_numpy(h)
    y = xp.empty(h.shape[:-2] + (cols,), dtype=h.dtype)
    _launch("swiglu_forward", h, cols, (h, y))
    return y


def swiglu_backward(h, dy, recompute=False):
    cols = _check(h, dy)
    if not is_device_array(h):
        return swiglu_backward_numpy(h, dy, recompute)
    dh = xp.empty_like(h)
    y = xp.empty(dy.shape, dtype=h.dtype) if recompute else None
    _launch("swiglu_backward", h, cols, (h, dy, dh, NULL if y is None else y))
    return (dh, y) if recompute else dh


def _check(h, dy=None):
    """F, after checking h (..., 2, F) and dy (..., F)."""
    arrays = {"h": [h]} if dy is None else {"h": [h], "dy": [dy]}
    dtypes = {name: check_lists(**{name: value})[name] for name, value in arrays.items()}
    dtype_suffix(h.dtype)
    if h.ndim < 2 or h.shape[-2] != 2:
        raise ValueError(f"swiglu: h must be (..., 2, F) (gate and up side by side), got "
                         f"{h.shape}")
    if dy is not None and (dy.shape != h.shape[:-2] + h.shape[-1:] or dtypes["dy"] != h.dtype):
        raise ValueError(f"swiglu_backward: dy must be {h.dtype} {h.shape[:-2] + h.shape[-1:]}, "
                         f"got {dy.dtype} {dy.shape}")
    return h.shape[-1]


def _launch(name, h, cols, arrays):
    rows = math.prod(h.shape[:-2])
    if not rows * cols:
        return
    vec = VECTOR_BYTES // h.itemsize
    pointers = 0
    for array in arrays:
        pointers |= 0 if isinstance(array, numpy.uint64) else array.data.ptr
    if cols % vec or pointers % VECTOR_BYTES:
        vec = 1
    kernel = get_kernel("swiglu.cu", f"{name}_{dtype_suffix(h.dtype)}_v{vec}")
    blocks = min(ceil_div(rows * cols // vec, THREADS), MAX_BLOCKS)
    kernel((blocks,), (THREADS,), arrays + (numpy.int64(rows), numpy.int32(cols)))


def _silu_parts(h):
    """(g, u, sigmoid(g)) of h in the compute dtype."""
    v = h.astype(compute_dtype(h.dtype))
    g, u = v[..., 0, :], v[..., 1, :]
    with numpy.errstate(over="ignore"):        # exp(-g) = inf: sigmoid 0, as on the GPU
        return g, u, 1 / (1 + numpy.exp(-g))


def swiglu_numpy(h):
    """NumPy twin of `swiglu`."""
    _check(h)
    g, u, s = _silu_parts(h)
    return (g * s * u).astype(h.dtype)


def swiglu_backward_numpy(h, dy, recompute=False):
    """NumPy twin of `swiglu_backward`."""
    _check(h, dy)
    g, u, s = _silu_parts(h)
    d = dy.astype(g.dtype)
    dh = numpy.stack([d * u * s * (1 + g * (1 - s)), d * g * s], axis=-2).astype(h.dtype)
    return (dh, (g * s * u).astype(h.dtype)) if recompute else dh
