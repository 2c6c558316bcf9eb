"""Fused multi-tensor AdamW with torch.optim.AdamW semantics: `adamw.cu` for CuPy arrays (one
launch for the whole list), a NumPy twin otherwise.

Per element, with bc1 = 1 - beta1^step and bc2 = 1 - beta2^step:
    p = p - lr wd p
    m = beta1 m + (1 - beta1) g
    v = beta2 v + (1 - beta2) g^2
    p = p - lr (m / bc1) / (sqrt(v / bc2) + eps)
evaluated as torch does: p = (1 - lr wd) p - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps). No
amsgrad, no maximize. The per-step scalars (`adamw_scalars`: lr, betas, eps, decay and the step
count, float64) are read from device memory when the kernel runs, so a CUDA graph replays each
step with that step's values; the bias corrections are computed there in float64 from
t = step - skipped and rounded to the params' dtype with the other scalars.

Dynamic loss scaling (`cupytp.optim.GradScaler`): with `found_inf` (a float32 device scalar,
non-zero when a gradient of this step is not finite) nothing is updated, and `skipped` (a float64
device scalar that the optimizer advances after such a step) keeps t the number of steps taken.

`casts`: a list beside float32 params of 16-bit arrays (one dtype, bfloat16 or float16) or None:
each given array gets its parameter's new value rounded to its dtype in the same pass (autocast's
kept copies, which the next forward then reads as they are).
"""
import math

import numpy

from cupytp.backend import bfloat16, c_contiguous, xp
from cupytp.launchers import dtype_suffix, get_kernel, is_device_array, nullable
from cupytp.launchers.multi_tensor import THREADS, check_optimizer_lists, tensor_table

NULL = numpy.uint64(0)


def adamw_scalars(*, lr, beta1, beta2, eps, weight_decay, step):
    """The kernel's scalars in float64: decay, beta1, 1 - beta1, beta2, 1 - beta2, lr, step, eps
    (step counts from 1)."""
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    return (1 - lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, lr, step, eps)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, scalars, found_inf=None, skipped=None,
               checked=False, casts=None):
    """One AdamW step, in place on params, exp_avgs and exp_avg_sqs.

    params/exp_avgs/exp_avg_sqs: lists of C-contiguous arrays of one dtype, float32 or float64
    (also the compute dtype); grads: same shapes, the params' dtype or bfloat16/float16.
    `scalars`: `adamw_scalars(...)`, or (GPU) a float64 device vector holding them, read when the
    kernel runs; `found_inf`, `skipped`: see the module docstring (None: no loss scaling);
    `checked`: see `check_optimizer_lists` (the casts, too, are then made like their
    parameters); `casts`: see the module docstring. On the GPU one kernel launch updates the
    whole list, with no host synchronisation.
    """
    cast_dtype = _cast_dtype(params, casts, checked)
    if not (params and is_device_array(params[0])):
        adamw_step_numpy(params, grads, exp_avgs, exp_avg_sqs, scalars, found_inf, skipped,
                         casts)
        return
    param_dtype, grad_dtype = check_optimizer_lists(params, grads, checked=checked,
                                                    exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if not is_device_array(scalars):
        scalars = xp.asarray(numpy.asarray(scalars, dtype=numpy.float64))
    lists = [params, grads, exp_avgs, exp_avg_sqs] + ([] if cast_dtype is None else [casts])
    table = tensor_table(lists)
    if table.num_blocks == 0:
        return
    kernel = get_kernel("adamw.cu", f"adamw_{dtype_suffix(param_dtype)}_"
                        f"{dtype_suffix(grad_dtype)}_{dtype_suffix(cast_dtype or bfloat16)}")
    rows = table.rows if cast_dtype is not None else table.rows + (NULL,)
    kernel((table.num_blocks,), (THREADS,), (*rows, table.blocks, scalars,
                                             nullable(found_inf, numpy.float32),
                                             nullable(skipped, numpy.float64)))


def _cast_dtype(params, casts, checked=False):
    """The one 16-bit dtype of the given `casts` (None: none given), after checking each
    against its parameter (C-contiguous, the parameter's shape) unless `checked`."""
    if casts is None:
        return None
    if checked:
        return next((numpy.dtype(c.dtype) for c in casts if c is not None), None)
    if len(casts) != len(params):
        raise ValueError(f"adamw_step: casts must have one entry per parameter ({len(params)}), "
                         f"got {len(casts)}")
    if params and params[0].dtype != numpy.float32 and any(c is not None for c in casts):
        raise ValueError(f"adamw_step: casts are of float32 parameters (autocast keeps those), "
                         f"got {params[0].dtype} parameters")
    dtypes = set()
    for p, c in zip(params, casts):
        if c is None:
            continue
        if c.shape != p.shape or not c_contiguous(c):
            raise ValueError(f"adamw_step: a cast must be C-contiguous of its parameter's shape "
                             f"{p.shape}, got {c.shape}")
        dtypes.add(numpy.dtype(c.dtype))
    if not dtypes:
        return None
    if len(dtypes) > 1 or not dtypes <= {numpy.dtype(bfloat16), numpy.dtype(numpy.float16)}:
        raise ValueError(f"adamw_step: casts must be of one dtype, bfloat16 or float16, got "
                         f"{sorted(map(str, dtypes))}")
    return dtypes.pop()


def adamw_step_numpy(params, grads, exp_avgs, exp_avg_sqs, scalars, found_inf=None,
                     skipped=None, casts=None):
    """NumPy twin of `adamw_step`."""
    _cast_dtype(params, casts)
    dtypes = check_optimizer_lists(params, grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if dtypes is None or (found_inf is not None and found_inf.reshape(-1)[0] != 0):
        return
    values = numpy.asarray(scalars, dtype=numpy.float64)[:8]
    t = values[6] - (0.0 if skipped is None else float(skipped.reshape(-1)[0]))
    lr, beta1, beta2 = values[5], values[1], values[3]
    (decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt,
     eps) = (dtypes[0].type(value) for value in (
        values[0], beta1, values[2], beta2, values[4], lr / (1.0 - beta1 ** t),
        math.sqrt(1.0 - beta2 ** t), values[7]))
    for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, casts or [None] * len(params)):
        g = g.astype(p.dtype)
        m[...] = beta1 * m + one_minus_beta1 * g
        v[...] = beta2 * v + one_minus_beta2 * g * g
        p[...] = decay * p - step_size * m / (numpy.sqrt(v) / bias_correction2_sqrt + eps)
        if c is not None:
            c[...] = p.astype(c.dtype)
