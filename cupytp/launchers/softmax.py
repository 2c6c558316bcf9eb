"""Causal softmax of attention scores (..., T, S) and its gradient: `softmax.cu` for CuPy arrays,
a NumPy twin otherwise. Query t sees keys s <= t + S - T; the scores are scaled by `scale`
first; a row with no visible key is all zeros. Computed in float32 (float64 for float64)."""
import numpy

from cupytp.backend import xp
from cupytp.launchers import BLOCK_THREADS, check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.launchers import is_device_array



def causal_softmax(x, scale):
    """softmax(scale · x) over the last dimension, causally masked; a new array."""
    if not is_device_array(x):
        return causal_softmax_numpy(x, scale)
    _check(x=x)
    y = xp.empty_like(x)
    _launch("causal_softmax_forward", x, (x, y, numpy.int32(x.shape[-2])), scale)
    return y


def causal_softmax_backward(y, g, scale):
    """dL/dx of y = causal_softmax(x, scale) given g = dL/dy; a new array."""
    if not is_device_array(y):
        return causal_softmax_backward_numpy(y, g, scale)
    _check(x=y, g=g)
    dx = xp.empty_like(y)
    _launch("causal_softmax_backward", y, (y, g, dx), scale)
    return dx


def _check(**arrays):
    dtypes = check_lists(**{name: [array] for name, array in arrays.items()})
    dtype_suffix(dtypes["x"])
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"causal_softmax: mixed dtypes {dtypes}")
    if arrays["x"].ndim < 2:
        raise ValueError(f"causal_softmax needs (..., T, S) scores, got {arrays['x'].shape}")


def _launch(name, x, arrays, scale):
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows == 0:
        return
    kernel = get_kernel("softmax.cu", f"{name}_{dtype_suffix(x.dtype)}")
    compute = compute_dtype(x.dtype)
    kernel((rows,), (BLOCK_THREADS,),
           (*arrays, numpy.int32(x.shape[-1]), compute.type(scale)))


def _visible(t_len, s_len):
    """Boolean (T, S): key s is visible to query t."""
    return numpy.arange(s_len)[None, :] <= numpy.arange(t_len)[:, None] + s_len - t_len


def causal_softmax_numpy(x, scale):
    compute = compute_dtype(x.dtype)
    visible = _visible(*x.shape[-2:])
    v = numpy.where(visible, x.astype(compute) * compute.type(scale), -numpy.inf)
    m = v.max(axis=-1, keepdims=True)
    e = numpy.where(visible, numpy.exp(v - numpy.where(numpy.isfinite(m), m, 0)), 0)
    total = e.sum(axis=-1, keepdims=True)
    y = numpy.divide(e, total, out=numpy.zeros_like(e), where=total > 0)
    return y.astype(x.dtype)


def causal_softmax_backward_numpy(y, g, scale):
    compute = compute_dtype(y.dtype)
    yc, gc = y.astype(compute), g.astype(compute)
    dot = (gc * yc).sum(axis=-1, keepdims=True)
    return (compute.type(scale) * yc * (gc - dot)).astype(y.dtype)
