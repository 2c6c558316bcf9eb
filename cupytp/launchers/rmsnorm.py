"""RMSNorm over the last dimension: `rmsnorm.cu` for CuPy arrays, a NumPy twin otherwise.

`rms_norm_forward(x, weight, eps, out_dtype=None)` → (y, rstd): y = x · rstd · weight in
`out_dtype` (x's by default; a 16-bit dtype for a float32 x under autocast, rounded once from the
float32 result), rstd = 1 / sqrt(mean(x²) + eps) per row, shape x.shape[:-1] + (1,), in the
compute dtype (float32; float64 for float64). `rms_norm_backward(g, x, rstd, weight,
dx_dtype=None, add=None, weight_grad=False)` → dx in `dx_dtype` (g's by default), plus `add` (a
gradient of x from elsewhere, dx's dtype and shape: the residual stream's) summed before the one
rounding; the normalized input is recomputed from x, so the forward keeps nothing of the row's
size. weight may be None; when given it has x's dtype and shape (C,). With `weight_grad=True` it
returns (dx, the weight's gradient): the column sums of g · x · rstd in the compute dtype, summed
by the kernel in the same pass where the row fits its registers (partial sums of
`PARAM_GRAD_BLOCKS_PER_SM` blocks per multiprocessor, then `column_sum`).
"""
import functools

import numpy

from cupytp.backend import xp
from cupytp.launchers import compute_dtype, is_device_array
from cupytp.launchers.column_sum import column_sum
from cupytp.launchers.layernorm import (
    NULL, _Plan, _check, _returned, _signature, _suffix, check_add, dx_cast_after,
    run_backward)

OP = "rms_norm"


@functools.lru_cache(maxsize=256)
def _forward_plan(x, weight, out_dtype):
    """The _Plan of a forward over arrays of these signatures (after checking them)."""
    _check(x, (("weight", weight),), x[1], OP)
    return _Plan("forward", _suffix(x[1], out_dtype, OP), x[0], OP)


@functools.lru_cache(maxsize=256)
def _backward_plan(g, x, rstd, weight, add, dx_dtype):
    """The _Plan of a backward over arrays of these signatures (after checking them)."""
    check_add(add, g[0], dx_dtype, OP)
    if x[0] != g[0] or x[1] != dx_dtype:
        raise ValueError(f"rms_norm_backward: x must have g's shape {g[0]} and dx's dtype "
                         f"{dx_dtype}, got {x[1]} {x[0]}")
    _check(g, (("x", x), ("weight", weight), ("rstd", rstd), ("add", add)), dx_dtype, OP)
    return _Plan("backward", _suffix(dx_dtype, g[1], OP), g[0], OP)


def rms_norm_forward(x, weight, eps, out_dtype=None):
    out_dtype = numpy.dtype(out_dtype or x.dtype)
    if not is_device_array(x):
        _suffix(x.dtype, out_dtype, OP)     # the kernels' dtype pairs hold for the twin too
        return rms_norm_forward_numpy(x, weight, eps, out_dtype)
    plan = _forward_plan(_signature(x), _signature(weight), out_dtype)
    y = xp.empty(x.shape, dtype=out_dtype)
    rstd = xp.empty(x.shape[:-1] + (1,), dtype=plan.compute)
    if plan.rows:
        plan.forward((x, weight, y), (x, NULL if weight is None else weight, y, rstd,
                                      numpy.int32(plan.cols), plan.compute.type(eps)))
    return y, rstd


def rms_norm_backward(g, x, rstd, weight, dx_dtype=None, add=None, weight_grad=False,
                      cast=None):
    dx_dtype = numpy.dtype(dx_dtype or g.dtype)
    if not is_device_array(g):
        check_add(None if add is None else (add.shape, add.dtype), g.shape, dx_dtype, OP)
        _suffix(dx_dtype, g.dtype, OP)
        return rms_norm_backward_numpy(g, x, rstd, weight, dx_dtype, add, weight_grad, cast)
    plan = _backward_plan(_signature(g), _signature(x), _signature(rstd), _signature(weight),
                          _signature(add), dx_dtype)
    dx = xp.empty(g.shape, dtype=dx_dtype)
    args = (g, x, rstd, NULL if weight is None else weight, NULL if add is None else add, dx)
    sums, made = run_backward(plan, args, (g, x, weight, add, dx), 1 if weight_grad else 0,
                              lambda: (column_sum(g, x.astype(plan.compute) * rstd,
                                                  dtype=plan.compute),), cast, 1)
    return _returned(dx, sums if weight_grad else None, made, cast)


def rms_norm_forward_numpy(x, weight, eps, out_dtype=None):
    compute = compute_dtype(x.dtype)
    v = x.astype(compute)
    rstd = (1.0 / numpy.sqrt((v * v).mean(axis=-1, keepdims=True) + eps)).astype(compute)
    y = v * rstd
    y = y * weight.astype(compute) if weight is not None else y
    return y.astype(out_dtype or x.dtype), rstd


def rms_norm_backward_numpy(g, x, rstd, weight, dx_dtype=None, add=None, weight_grad=False,
                            cast=None):
    compute = rstd.dtype
    gc = g.astype(compute)
    xhat = x.astype(compute) * rstd
    d = gc * weight.astype(compute) if weight is not None else gc
    dx = rstd * (d - xhat * (d * xhat).mean(axis=-1, keepdims=True))
    dx = dx if add is None else dx + add.astype(compute)
    dx = dx.astype(dx_dtype or g.dtype)
    sums = ((gc * xhat).reshape(-1, g.shape[-1]).sum(axis=0),) if weight_grad else None
    return _returned(dx, sums, dx_cast_after(dx, cast, compute), cast)
