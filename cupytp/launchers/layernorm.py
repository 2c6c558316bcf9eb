"""LayerNorm over the last dimension: `layernorm.cu` for CuPy arrays, a NumPy twin otherwise.

`layer_norm_forward(x, weight, bias, eps, out_dtype=None)` → (y, xhat, rstd): y in `out_dtype`
(x's by default; a 16-bit dtype for a float32 x under autocast, rounded once from the float32
result); xhat (the normalized input) and rstd (per row) in the compute dtype (float32, float64
for float64), kept for `layer_norm_backward(g, xhat, rstd, weight, dx_dtype=None, add=None)` → dx in
`dx_dtype` (g's by default: x's, when g has y's 16-bit dtype), plus `add` (a gradient of x from
elsewhere, dx's dtype and shape: the residual stream's) summed in the same pass before the one
rounding. weight and bias may be None; when given they have x's dtype and shape (C,). With
`param_grads=True` it returns (dx, the weight's gradient, the bias's): the column sums of g xhat
and of g in the compute dtype, summed by the kernel in the same pass where the row fits its
registers (partial sums of `PARAM_GRAD_BLOCKS_PER_SM` blocks per multiprocessor, then `column_sum`).
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import (
    BLOCK_THREADS, ceil_div, check_lists, compute_dtype, dtype_suffix, get_kernel, is_device_array,
    multiprocessors, vector_width)
from cupytp.launchers.column_sum import column_sum

NULL = numpy.uint64(0)
# blocks (partial sums per column) of a backward that sums the parameter gradients; on an H200,
# 40 us at [4096, 2048] against 49 with 2 per multiprocessor and 46 with 8
PARAM_GRAD_BLOCKS_PER_SM = 4
VECTOR = {"f32": 4, "f64": 2, "bf16": 8, "f16": 8, "f32_bf16": 8, "f32_f16": 8}  # see the .cu
CACHED_VECTORS = (1, 2, 4)      # vectors per thread of the cached kernels


def _check(x, weight, bias, dtype=None):
    """Each array on its own (check_lists compares shapes across lists, position by position);
    weight and bias must have `dtype` (x's by default) and shape (C,)."""
    dtype = dtype or x.dtype
    dtype_suffix(check_lists(x=[x])["x"])
    for name, array in (("weight", weight), ("bias", bias)):
        if array is not None:
            check_lists(**{name: [array]})
        if array is not None and (array.dtype != dtype or array.shape != x.shape[-1:]):
            raise ValueError(f"layer_norm: {name} must have dtype {dtype} and shape "
                             f"{x.shape[-1:]}, got {array.dtype} {array.shape}")


def layer_norm_forward(x, weight, bias, eps, out_dtype=None):
    out_dtype = numpy.dtype(out_dtype or x.dtype)
    if not is_device_array(x):
        return layer_norm_forward_numpy(x, weight, bias, eps, out_dtype)
    _check(x, weight, bias)
    compute = compute_dtype(x.dtype)
    cols = x.shape[-1]
    rows = x.size // cols if cols else 0
    y = xp.empty(x.shape, dtype=out_dtype)
    xhat = xp.empty(x.shape, dtype=compute)
    rstd = xp.empty(x.shape[:-1] + (1,), dtype=compute)
    if rows:
        suffix = _suffix(x.dtype, out_dtype)
        name = _cached_kernel("forward", suffix, cols, (x, weight, bias, y, xhat)) or \
            f"layer_norm_forward_{suffix}"
        get_kernel("layernorm.cu", name)(
            (rows,), (BLOCK_THREADS,), (x, NULL if weight is None else weight,
                                        NULL if bias is None else bias, y, xhat, rstd,
                                        numpy.int32(cols), compute.type(eps)))
    return y, xhat, rstd


def layer_norm_backward(g, xhat, rstd, weight, dx_dtype=None, add=None, param_grads=False):
    dx_dtype = numpy.dtype(dx_dtype or g.dtype)
    if add is not None and (add.dtype != dx_dtype or add.shape != g.shape):
        raise ValueError(f"layer_norm_backward: add must have dx's dtype {dx_dtype} and shape "
                         f"{g.shape}, got {add.dtype} {add.shape}")
    if not is_device_array(g):
        return layer_norm_backward_numpy(g, xhat, rstd, weight, dx_dtype, add, param_grads)
    _check(g, weight, None, dx_dtype)
    check_lists(xhat=[xhat])
    check_lists(rstd=[rstd])
    if add is not None:
        check_lists(add=[add])
    cols = g.shape[-1]
    rows = g.size // cols if cols else 0
    dx = xp.empty(g.shape, dtype=dx_dtype)
    suffix = _suffix(dx_dtype, g.dtype)
    args = (g, xhat, rstd, NULL if weight is None else weight, NULL if add is None else add, dx)
    cached = _cached_kernel("backward", suffix, cols, (g, xhat, weight, add, dx))
    if cached is None or not rows:       # streaming: the parameter gradients by column sums
        if rows:
            get_kernel("layernorm.cu", f"layer_norm_backward_{suffix}")(
                (rows,), (BLOCK_THREADS,), args + (numpy.int32(cols),))
        if not param_grads:
            return dx
        return dx, column_sum(g, xhat, dtype=xhat.dtype), column_sum(g, dtype=xhat.dtype)
    blocks = min(rows, PARAM_GRAD_BLOCKS_PER_SM * multiprocessors()) if param_grads else rows
    partials = xp.empty((blocks, 2 * cols), xhat.dtype) if param_grads else None
    get_kernel("layernorm.cu", cached)(
        (blocks,), (BLOCK_THREADS,),
        args + (NULL if partials is None else partials, numpy.int64(rows), numpy.int32(cols)))
    if not param_grads:
        return dx
    sums = column_sum(partials)
    # two arrays over the two halves, not views: each is the one array over its bytes, so the
    # parameters take them as their gradients without a copy
    return dx, xp.ndarray((cols,), sums.dtype, sums.data), \
        xp.ndarray((cols,), sums.dtype, sums.data + cols * sums.itemsize)


def _cached_kernel(direction, suffix, cols, arrays):
    """The name of the cached form when the row fits the block's registers and every array is
    aligned for its vectors, else None (the streaming form serves)."""
    vec = VECTOR[suffix]
    per_thread = ceil_div(cols, BLOCK_THREADS * vec)
    vectors = next((n for n in CACHED_VECTORS if n >= per_thread), None)
    if vectors is None or vector_width(vec, cols, [a for a in arrays if a is not None]) != vec:
        return None
    return f"layer_norm_{direction}_cached_{suffix}_v{vec}_n{vectors}"


def _suffix(dtype, out_dtype):
    """The instantiation for storage `dtype` with y and g in `out_dtype`: the same dtype, or a
    float32 x with bf16/fp16 y."""
    if out_dtype == dtype:
        return dtype_suffix(dtype)
    if dtype != numpy.float32 or dtype_suffix(out_dtype) not in ("bf16", "f16"):
        raise ValueError(f"layer_norm: no kernel for input {dtype} with output {out_dtype}: the "
                         "output has the input's dtype, or bf16/fp16 for a float32 input")
    return f"f32_{dtype_suffix(out_dtype)}"


def layer_norm_forward_numpy(x, weight, bias, eps, out_dtype=None):
    compute = compute_dtype(x.dtype)
    v = x.astype(compute)
    centered = v - v.mean(axis=-1, keepdims=True)
    rstd = 1.0 / numpy.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    xhat = centered * rstd
    y = xhat * weight.astype(compute) if weight is not None else xhat
    y = y + bias.astype(compute) if bias is not None else y
    return y.astype(out_dtype or x.dtype), xhat, rstd.astype(compute)


def layer_norm_backward_numpy(g, xhat, rstd, weight, dx_dtype=None, add=None,
                              param_grads=False):
    compute = xhat.dtype
    gc = g.astype(compute)
    d = gc * weight.astype(compute) if weight is not None else gc
    dx = rstd * (d - d.mean(axis=-1, keepdims=True)
                 - xhat * (d * xhat).mean(axis=-1, keepdims=True))
    dx = dx if add is None else dx + add.astype(compute)
    dx = dx.astype(dx_dtype or g.dtype)
    if not param_grads:
        return dx
    cols = g.shape[-1]
    return (dx, (gc * xhat).reshape(-1, cols).sum(axis=0),
            gc.reshape(-1, cols).sum(axis=0))
