"""Dropout in one pass, with a 1-bit mask for the backward: `dropout.cu` for CuPy arrays, the
NumPy twin otherwise.

`dropout(x, p, counters, bias=None, residual=None, keep_mask=True)` → (out, mask):
out = residual + (x + bias) * (keep ? 1/(1-p) : 0), element i kept by philox.py's dropout rule
at its counter (`counters`, a `philox.Counters` of x's block: eight elements per Philox
call); bias (cols,) along the last dimension and residual (x's shape) optional, both of out's
dtype, which is x's, or with a residual the residual's (x's or its compute dtype: autocast's fp32 residual stream beside a
16-bit product). The mask (uint8, one bit per element, `numpy.packbits(keep, bitorder="little")`
of the flattened block) only with `keep_mask`.
`dropout_backward(g, mask, p, dtype=None)` → g * (bit ? 1/(1-p) : 0) as `dtype` (g's by
default; x's dtype for the gradient of a 16-bit x with an fp32 residual).

Computed in the compute dtype (float32 for 16-bit and float32, float64 for float64), rounded
once; 1/(1-p) rounded to the compute dtype. The backward reads the mask rather than drawing the
numbers again: one bit per element read against an eighth of a Philox call per element written
(bench/dropout.py times both).
"""
import numpy

from cupytp.backend import c_contiguous, xp
from cupytp.launchers import (
    ceil_div, compute_dtype, dtype_suffix, get_kernel, has_kernel, is_device_array,
    multiprocessors, nullable)
from cupytp.launchers.philox import dropout_keeps, keep_threshold

ELEMENTS = 8            # per thread (one mask byte), as in dropout.cu
THREADS = 256
BLOCKS_PER_SM = 16      # at most this many blocks per multiprocessor; the threads stride on
NULL = numpy.uint64(0)


def applies(x_dtype, bias_dtype=None, residual_dtype=None):
    """True for the dtypes the kernels take: x of a kernel dtype, the residual of x's dtype or
    its compute dtype, the bias of the output's (x's without a residual, else the residual's);
    None for an absent bias or residual."""
    out = x_dtype if residual_dtype is None else residual_dtype
    return _pair(x_dtype, out) and (bias_dtype is None or bias_dtype == out)


def _pair(dtype, out_dtype):
    """True when a kernel reads `dtype` and writes `out_dtype` (or the reverse, backward)."""
    return has_kernel(dtype) and out_dtype in (dtype, compute_dtype(dtype))


def _check(x, p, counters, bias, residual):
    if not 0 < p < 1:
        raise ValueError(f"dropout: p must be in (0, 1), got {p}")
    if not applies(x.dtype, *(None if a is None else a.dtype for a in (bias, residual))):
        raise ValueError(f"dropout: no kernel for x {x.dtype} with bias "
                         f"{None if bias is None else bias.dtype} and residual "
                         f"{None if residual is None else residual.dtype}: the residual has x's "
                         "dtype or its compute dtype, the bias the output's")
    if not c_contiguous(x) or tuple(counters.local_shape) != x.shape:
        raise ValueError(f"dropout: x must be C-contiguous with the counters' block shape "
                         f"{counters.local_shape}, got {x.shape}")
    if bias is not None and (bias.shape != x.shape[-1:] or not c_contiguous(bias)):
        raise ValueError(f"dropout: the bias must be a contiguous {x.shape[-1:]}, got "
                         f"{bias.shape}")
    if residual is not None and (residual.shape != x.shape or not c_contiguous(residual)):
        raise ValueError(f"dropout: the residual must be a contiguous {x.shape}, got "
                         f"{residual.shape}")


def dropout(x, p, counters, bias=None, residual=None, keep_mask=True):
    _check(x, p, counters, bias, residual)
    if not is_device_array(x):
        return dropout_numpy(x, p, counters, bias, residual, keep_mask)
    out = xp.empty(x.shape, dtype=x.dtype if residual is None else residual.dtype)
    mask = xp.empty(ceil_div(x.size, ELEMENTS), dtype=numpy.uint8) if keep_mask else None
    if x.size:
        compute = compute_dtype(x.dtype)
        name = f"dropout_{dtype_suffix(x.dtype)}_{dtype_suffix(out.dtype)}"
        _launch(name, x.size, (x, nullable(bias, out.dtype), nullable(residual, out.dtype), out,
                               nullable(mask, numpy.uint8), numpy.int64(x.size),
                               numpy.int32(x.shape[-1] if x.ndim else 1),
                               _vectors(x, residual, out),
                               numpy.uint64(keep_threshold(p)), compute.type(1 / (1 - p)),
                               *counters.arguments()))
    return out, mask


def dropout_backward(g, mask, p, dtype=None):
    dtype = numpy.dtype(dtype or g.dtype)
    if not c_contiguous(g) or mask.shape != (ceil_div(g.size, ELEMENTS),):
        raise ValueError(f"dropout_backward: g must be C-contiguous and the mask hold "
                         f"{ceil_div(g.size, ELEMENTS)} bytes, got {mask.shape}")
    if not is_device_array(g):
        return dropout_backward_numpy(g, mask, p, dtype)
    if not _pair(dtype, g.dtype):
        raise ValueError(f"dropout_backward: no kernel for a {g.dtype} gradient of {dtype}")
    dx = xp.empty(g.shape, dtype=dtype)
    if g.size:
        name = f"dropout_backward_{dtype_suffix(dtype)}_{dtype_suffix(g.dtype)}"
        _launch(name, g.size, (g, mask, dx, numpy.int64(g.size), _vectors(g, dx),
                               compute_dtype(dtype).type(1 / (1 - p))))
    return dx


def _vectors(*arrays):
    """Whether every array starts on a vector of ELEMENTS of its elements."""
    return numpy.bool_(all(a is None or not a.data.ptr % (ELEMENTS * a.itemsize)
                           for a in arrays))


def _launch(name, count, args):
    groups = ceil_div(count, ELEMENTS)
    grid = min(ceil_div(groups, THREADS), BLOCKS_PER_SM * multiprocessors())
    get_kernel("dropout.cu", name)((grid,), (THREADS,), args)


# ---- NumPy twins ---------------------------------------------------------------------------------
def dropout_numpy(x, p, counters, bias=None, residual=None, keep_mask=True):
    """Twin of `dropout`."""
    compute = compute_dtype(x.dtype)
    keep = dropout_keeps(counters.seed, counters.indices(), p)
    v = x.astype(compute)
    if bias is not None:
        v = v + bias.astype(compute)
    v = v * numpy.where(keep, compute.type(1 / (1 - p)), compute.type(0))
    if residual is not None:
        v = residual.astype(compute) + v
    out = v.astype(x.dtype if residual is None else residual.dtype)
    return out, (numpy.packbits(keep.reshape(-1), bitorder="little") if keep_mask else None)


def dropout_backward_numpy(g, mask, p, dtype=None):
    """Twin of `dropout_backward`."""
    dtype = numpy.dtype(dtype or g.dtype)
    compute = compute_dtype(dtype)
    keep = numpy.unpackbits(mask, count=g.size, bitorder="little").reshape(g.shape)
    scale = numpy.where(keep, compute.type(1 / (1 - p)), compute.type(0))
    return (g.astype(compute) * scale).astype(dtype)
