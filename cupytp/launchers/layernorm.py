"""LayerNorm over the last dimension: `layernorm.cu` for CuPy arrays, a NumPy twin otherwise.

`layer_norm_forward(x, weight, bias, eps, out_dtype=None, saved=True)` → (y, mean, rstd): y in
`out_dtype` (x's by default; a 16-bit dtype for a float32 x under autocast, rounded once from the
float32 result); mean and rstd per row, shape x.shape[:-1] + (1,), in the compute dtype
(float32, float64 for float64; None, and not written, with `saved=False`: a forward no backward
follows), kept with x for `layer_norm_backward(g, x, mean, rstd, weight, dx_dtype=None,
add=None)` → dx in `dx_dtype` (g's by default: x's, when g has y's 16-bit dtype), plus `add` (a
gradient of x from elsewhere, dx's dtype and shape: the residual stream's) summed in the same
pass before the one rounding. The backward recomputes the normalized input xhat = (x - mean) rstd
from x, as the forward computed it, so the forward writes nothing of the row's size but y (x,
the residual stream, is what the caller keeps). weight and bias may be None; when given they
have x's dtype and shape (C,). With `param_grads=True` it returns (dx, the weight's gradient, the
bias's): the column sums of g xhat and of g in the compute dtype, summed by the kernel in the
same pass where the row fits its registers (partial sums of `PARAM_GRAD_BLOCKS_PER_SM` blocks
per multiprocessor, then `column_sum`).
"""
import functools
import math

import numpy

from cupytp.backend import c_contiguous, xp
from cupytp.launchers import (
    BLOCK_THREADS, ceil_div, compute_dtype, dtype_suffix, get_kernel, is_device_array,
    multiprocessors)
from cupytp.launchers.cast import converted
from cupytp.launchers.column_sum import column_sum, column_sum_and_cast

NULL = numpy.uint64(0)
# blocks (partial sums per column) of a backward that sums the parameter gradients; on an H200,
# 40 us at [4096, 2048] against 49 with 2 per multiprocessor and 46 with 8
PARAM_GRAD_BLOCKS_PER_SM = 4
VECTOR = {"f32": 4, "f64": 2, "bf16": 8, "f16": 8, "f32_bf16": 8, "f32_f16": 8}  # see the .cu
CACHED_VECTORS = (1, 2, 4)      # vectors per thread of the cached kernels
SOURCES = {"layer_norm": "layernorm.cu", "rms_norm": "rmsnorm.cu"}   # the norms' kernel files


class _Plan:
    """How one signature of arrays launches (worked out and checked once per signature): the
    row-cached kernel (None where the row does not fit the registers), the streaming one, the
    byte alignment of every pointer that the cached one needs, the compute dtype, and rows and
    cols. `op` names the norm ("layer_norm", or "rms_norm": rmsnorm.cu's kernels, made the
    same way)."""
    __slots__ = ("cached", "streaming", "alignment", "compute", "rows", "cols", "block")

    def __init__(self, direction, suffix, shape, op="layer_norm"):
        vec = VECTOR[suffix]
        self.cols = shape[-1] if shape else 0
        self.rows = math.prod(shape[:-1]) if self.cols else 0
        per_thread = ceil_div(self.cols, BLOCK_THREADS * vec)
        vectors = next((n for n in CACHED_VECTORS if n >= per_thread), None)
        self.cached = None if vectors is None or self.cols % vec else \
            get_kernel(SOURCES[op], f"{op}_{direction}_cached_{suffix}_v{vec}_n{vectors}")
        self.streaming = get_kernel(SOURCES[op], f"{op}_{direction}_{suffix}")
        # the cached kernels' rows: the fewest whole warps that hold a row, as many rows a
        # block as fit (GPT-2's 768 fp32 columns: 96 lanes of 8, 2 rows a block of 192); a
        # backward with one row a block takes the whole block (faster than fewer lanes: 70
        # against 73 us at (8192, 1280) on an H100)
        lanes = min(BLOCK_THREADS, ceil_div(ceil_div(self.cols, vec * (vectors or 1)), 32) * 32)
        rows_a_block = BLOCK_THREADS // lanes
        self.block = (BLOCK_THREADS, 1) if direction == "backward" and rows_a_block == 1 else \
            (lanes, rows_a_block)
        self.alignment = vec * 8 if suffix == "f64" else vec * 4     # vectors of the widest
        self.compute = compute_dtype(numpy.float64 if suffix == "f64" else numpy.float32)

    def kernel(self, *arrays):
        """The cached kernel when it applies and every array (None: absent) is aligned for it,
        else the streaming one."""
        if self.cached is None:
            return self.streaming
        pointers = 0
        for array in arrays:
            if array is not None:
                pointers |= array.data.ptr
        return self.streaming if pointers % self.alignment else self.cached

    def forward(self, arrays, args):
        """Launch a forward over `args` (ending in cols and eps) of which `arrays` are the
        device arrays: the cached kernel with `block` (rows of lanes; it takes the row count
        before cols), or the streaming one, a block of BLOCK_THREADS a row."""
        kernel = self.kernel(*arrays)
        if kernel is self.cached:
            kernel((ceil_div(self.rows, self.block[1]),), self.block,
                   args[:-2] + (numpy.int64(self.rows),) + args[-2:])
        else:
            kernel((self.rows,), (BLOCK_THREADS,), args)


def _signature(array):
    return None if array is None else (array.shape, array.dtype, c_contiguous(array))


@functools.lru_cache(maxsize=256)
def _forward_plan(x, weight, bias, out_dtype):
    """The _Plan of a forward over arrays of these signatures (after checking them)."""
    _check(x, (("weight", weight), ("bias", bias)), x[1])
    return _Plan("forward", _suffix(x[1], out_dtype), x[0])


@functools.lru_cache(maxsize=256)
def _backward_plan(g, x, mean, rstd, weight, add, dx_dtype):
    """The _Plan of a backward over arrays of these signatures (after checking them)."""
    check_add(add, g[0], dx_dtype)
    if x[0] != g[0] or x[1] != dx_dtype:
        raise ValueError(f"layer_norm_backward: x must have g's shape {g[0]} and dx's dtype "
                         f"{dx_dtype}, got {x[1]} {x[0]}")
    _check(g, (("weight", weight), ("x", x), ("mean", mean), ("rstd", rstd), ("add", add)),
           dx_dtype)
    return _Plan("backward", _suffix(dx_dtype, g[1]), g[0])


def check_add(add, shape, dtype, op="layer_norm"):
    """`add` (a (shape, dtype) signature or None), the gradient a backward sums into dx, must
    have dx's dtype and shape."""
    if add is not None and (add[1] != dtype or add[0] != shape):
        raise ValueError(f"{op}_backward: add must have dx's dtype {dtype} and shape {shape}, "
                         f"got {add[1]} {add[0]}")


def _check(x, others, dtype, op="layer_norm"):
    """x and each of the `others` ((name, signature or None)) C-contiguous; a weight or bias
    of `dtype` and shape (C,)."""
    dtype_suffix(x[1])
    for name, signature in (("x", x),) + others:
        if signature is not None and not signature[2]:
            raise ValueError(f"{op}: {name} is not C-contiguous")
    for name, signature in others:
        if name in ("weight", "bias") and signature is not None and \
                (signature[1] != dtype or signature[0] != x[0][-1:]):
            raise ValueError(f"{op}: {name} must have dtype {dtype} and shape "
                             f"{x[0][-1:]}, got {signature[1]} {signature[0]}")


def layer_norm_forward(x, weight, bias, eps, out_dtype=None, saved=True):
    out_dtype = numpy.dtype(out_dtype or x.dtype)
    if not is_device_array(x):
        _suffix(x.dtype, out_dtype)         # the kernels' dtype pairs hold for the twin too
        return layer_norm_forward_numpy(x, weight, bias, eps, out_dtype, saved)
    plan = _forward_plan(_signature(x), _signature(weight), _signature(bias), out_dtype)
    compute = plan.compute
    y = xp.empty(x.shape, dtype=out_dtype)
    stats = xp.empty((2,) + x.shape[:-1] + (1,), dtype=compute) if saved else None
    mean, rstd = (None, None) if stats is None else (stats[0], stats[1])
    if plan.rows:
        plan.forward((x, weight, bias, y), (
            x, NULL if weight is None else weight, NULL if bias is None else bias, y,
            NULL if mean is None else mean, NULL if rstd is None else rstd,
            numpy.int32(plan.cols), compute.type(eps)))
    return y, mean, rstd


def layer_norm_backward(g, x, mean, rstd, weight, dx_dtype=None, add=None, param_grads=False,
                        cast=None):
    dx_dtype = numpy.dtype(dx_dtype or g.dtype)
    if not is_device_array(g):
        check_add(None if add is None else (add.shape, add.dtype), g.shape, dx_dtype)
        _suffix(dx_dtype, g.dtype)
        return layer_norm_backward_numpy(g, x, mean, rstd, weight, dx_dtype, add, param_grads,
                                         cast)
    plan = _backward_plan(_signature(g), _signature(x), _signature(mean), _signature(rstd),
                          _signature(weight), _signature(add), dx_dtype)
    dx = xp.empty(g.shape, dtype=dx_dtype)
    args = (g, x, mean, rstd, NULL if weight is None else weight, NULL if add is None else add,
            dx)

    def streaming_sums():       # the rows the cached kernel does not take: xhat made here
        xhat = (x.astype(rstd.dtype) - mean) * rstd
        return column_sum(g, xhat, dtype=rstd.dtype), column_sum(g, dtype=rstd.dtype)
    sums, made = run_backward(plan, args, (g, x, weight, add, dx), 2 if param_grads else 0,
                              streaming_sums, cast, 2)
    return _returned(dx, sums if param_grads else None, made, cast)


def _returned(dx, sums, made, cast):
    """A norm backward's result: dx, then the parameter sums where asked (`sums` not None),
    then the (cast, column sums) of dx where `cast` was asked."""
    out = (dx,) + (() if sums is None else tuple(sums)) + (() if cast is None else (made,))
    return out if len(out) > 1 else dx


def run_backward(plan, args, aligned, sums, streaming_sums, cast, param_slots):
    """Launch a norm's backward (`args`: its arrays up to dx) by `plan`: the row-cached kernel
    where it applies to the `aligned` arrays, which also sums the `sums` parameter gradients per
    column in its pass (partial sums of PARAM_GRAD_BLOCKS_PER_SM blocks per multiprocessor, then
    `column_sum`; the kernel's partials hold `param_slots` of them, then dx's), else the
    streaming one and `streaming_sums()`. `cast`: None, or (dtype, with_sum) for dx once more
    in that 16-bit dtype and, with_sum, dx's column sums (a gradient the next product reads in
    its dtype, and that product's bias gradient): made in the kernel's pass where it is the
    cached one, dx is float32 and `dtype` is g's, else by `column_sum_and_cast` after it.
    Returns (the `sums` column sums (cols,) each, (dx's cast, its column sums or None) or
    None)."""
    rows, cols = plan.rows, plan.cols
    g, dx = args[0], args[-1]
    kernel = plan.kernel(*aligned) if rows else None
    if kernel is None or kernel is plan.streaming:  # the parameter gradients by column sums
        if rows:
            kernel((rows,), (BLOCK_THREADS,), args + (numpy.int32(cols),))
        return streaming_sums() if sums else (), dx_cast_after(dx, cast, plan.compute)
    in_pass = cast is not None and dx.dtype == numpy.float32 and numpy.dtype(cast[0]) == g.dtype
    dx_cast = xp.empty(dx.shape, g.dtype) if in_pass else None
    dx_sum = in_pass and cast[1]
    slots = param_slots + 1 if dx_sum else sums
    groups = ceil_div(rows, plan.block[1])
    blocks = min(groups, PARAM_GRAD_BLOCKS_PER_SM * multiprocessors()) if slots else groups
    partials = xp.empty((blocks * plan.block[1], slots * cols), plan.compute) if slots else None
    kernel((blocks,), plan.block,
           args + (NULL if partials is None else partials,
                   NULL if dx_cast is None else dx_cast, numpy.int32(dx_sum),
                   numpy.int64(rows), numpy.int32(cols)))
    made = (dx_cast, None) if in_pass else dx_cast_after(dx, cast, plan.compute)
    if not slots:
        return (), made
    total = column_sum(partials)
    # arrays over each part, not views: each is the one array over its bytes, so the
    # parameters take them as their gradients without a copy
    parts = tuple(xp.ndarray((cols,), total.dtype, total.data + i * cols * total.itemsize)
                  for i in range(slots))
    if dx_sum:
        made = (dx_cast, parts[param_slots])
    return parts[:sums], made


def dx_cast_after(dx, cast, compute):
    """(dx in cast[0], with cast[1] dx's column sums in `compute`) by passes after the norm's
    (for NumPy arrays: the twin of the kernels' pass), or None without `cast`."""
    if cast is None:
        return None
    rows = dx.reshape(-1, dx.shape[-1])
    if cast[1]:
        sums, copy = column_sum_and_cast(rows, cast[0], compute)
        return copy.reshape(dx.shape), sums
    return converted(dx, cast[0]), None


def _suffix(dtype, out_dtype, op="layer_norm"):
    """The instantiation for storage `dtype` with y and g in `out_dtype`: the same dtype, or a
    float32 x with bf16/fp16 y."""
    if out_dtype == dtype:
        return dtype_suffix(dtype)
    if dtype != numpy.float32 or dtype_suffix(out_dtype) not in ("bf16", "f16"):
        raise ValueError(f"{op}: no kernel for input {dtype} with output {out_dtype}: the "
                         "output has the input's dtype, or bf16/fp16 for a float32 input")
    return f"f32_{dtype_suffix(out_dtype)}"


def layer_norm_forward_numpy(x, weight, bias, eps, out_dtype=None, saved=True):
    compute = compute_dtype(x.dtype)
    v = x.astype(compute)
    centered = v - v.mean(axis=-1, keepdims=True)
    rstd = 1.0 / numpy.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    xhat = centered * rstd
    y = xhat * weight.astype(compute) if weight is not None else xhat
    y = (y + bias.astype(compute) if bias is not None else y).astype(out_dtype or x.dtype)
    mean = v.mean(axis=-1, keepdims=True).astype(compute)
    return (y, mean, rstd.astype(compute)) if saved else (y, None, None)


def layer_norm_backward_numpy(g, x, mean, rstd, weight, dx_dtype=None, add=None,
                              param_grads=False, cast=None):
    compute = rstd.dtype
    xhat = (x.astype(compute) - mean) * rstd
    gc = g.astype(compute)
    d = gc * weight.astype(compute) if weight is not None else gc
    dx = rstd * (d - d.mean(axis=-1, keepdims=True)
                 - xhat * (d * xhat).mean(axis=-1, keepdims=True))
    dx = dx if add is None else dx + add.astype(compute)
    dx = dx.astype(dx_dtype or g.dtype)
    cols = g.shape[-1]
    sums = ((gc * xhat).reshape(-1, cols).sum(axis=0), gc.reshape(-1, cols).sum(axis=0)) \
        if param_grads else None
    return _returned(dx, sums, dx_cast_after(dx, cast, compute), cast)
