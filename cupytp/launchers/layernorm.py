"""LayerNorm over the last dimension: `layernorm.cu` for CuPy arrays, a NumPy twin otherwise.

`layer_norm_forward(x, weight, bias, eps)` → (y, xhat, rstd): y in x's dtype; xhat (the
normalized input) and rstd (per row) in the compute dtype (float32, float64 for float64), kept
for `layer_norm_backward(g, xhat, rstd, weight)` → dx. weight and bias may be None; when given
they have x's dtype and shape (C,).
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import BLOCK_THREADS, check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.launchers import is_device_array

NULL = numpy.uint64(0)


def _check(x, weight, bias):
    """Each array on its own (check_lists compares shapes across lists, position by position)."""
    dtype_suffix(check_lists(x=[x])["x"])
    for name, array in (("weight", weight), ("bias", bias)):
        if array is not None:
            check_lists(**{name: [array]})
        if array is not None and (array.dtype != x.dtype or array.shape != x.shape[-1:]):
            raise ValueError(f"layer_norm: {name} must have dtype {x.dtype} and shape "
                             f"{x.shape[-1:]}, got {array.dtype} {array.shape}")


def layer_norm_forward(x, weight, bias, eps):
    if not is_device_array(x):
        return layer_norm_forward_numpy(x, weight, bias, eps)
    _check(x, weight, bias)
    compute = compute_dtype(x.dtype)
    cols = x.shape[-1]
    rows = x.size // cols if cols else 0
    y = xp.empty_like(x)
    xhat = xp.empty(x.shape, dtype=compute)
    rstd = xp.empty(x.shape[:-1] + (1,), dtype=compute)
    if rows:
        kernel = get_kernel("layernorm.cu", f"layer_norm_forward_{dtype_suffix(x.dtype)}")
        kernel((rows,), (BLOCK_THREADS,), (x, NULL if weight is None else weight,
                                           NULL if bias is None else bias, y, xhat, rstd,
                                           numpy.int32(cols), compute.type(eps)))
    return y, xhat, rstd


def layer_norm_backward(g, xhat, rstd, weight):
    if not is_device_array(g):
        return layer_norm_backward_numpy(g, xhat, rstd, weight)
    _check(g, weight, None)
    check_lists(xhat=[xhat])
    check_lists(rstd=[rstd])
    cols = g.shape[-1]
    rows = g.size // cols if cols else 0
    dx = xp.empty_like(g)
    if rows:
        kernel = get_kernel("layernorm.cu", f"layer_norm_backward_{dtype_suffix(g.dtype)}")
        kernel((rows,), (BLOCK_THREADS,), (g, xhat, rstd, NULL if weight is None else weight,
                                           dx, numpy.int32(cols)))
    return dx


def layer_norm_forward_numpy(x, weight, bias, eps):
    compute = compute_dtype(x.dtype)
    v = x.astype(compute)
    centered = v - v.mean(axis=-1, keepdims=True)
    rstd = 1.0 / numpy.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    xhat = centered * rstd
    y = xhat * weight.astype(compute) if weight is not None else xhat
    y = y + bias.astype(compute) if bias is not None else y
    return y.astype(x.dtype), xhat, rstd.astype(compute)


def layer_norm_backward_numpy(g, xhat, rstd, weight):
    compute = xhat.dtype
    d = g.astype(compute) * weight.astype(compute) if weight is not None else g.astype(compute)
    dx = rstd * (d - d.mean(axis=-1, keepdims=True)
                 - xhat * (d * xhat).mean(axis=-1, keepdims=True))
    return dx.astype(g.dtype)
