"""Fused multi-tensor SGD with torch.optim.SGD semantics: `sgd.cu` for CuPy arrays (one launch for
the whole list), a NumPy twin otherwise.

Per element:
    g = g + wd p                                        (if wd != 0)
    buf = g on the first step, else momentum buf + (1 - dampening) g   (if momentum != 0)
    g = g + momentum buf if nesterov, else buf          (if momentum != 0)
    p = p - lr g
No maximize. The scalars (`sgd_scalars`) are float64, rounded to the params' dtype; the kernel
reads them from device memory, so a CUDA graph replays each step with that step's values.
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import dtype_suffix, get_kernel, is_device_array, nullable
from cupytp.launchers.multi_tensor import THREADS, check_optimizer_lists, tensor_table


def sgd_scalars(*, lr, momentum, dampening, weight_decay, nesterov=False):
    """The kernel's scalars in float64: lr, momentum, 1 - dampening, weight_decay; raises
    ValueError as torch does for nesterov without momentum or with dampening."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0")
    return (lr, momentum, 1 - dampening, weight_decay)


def sgd_step(params, grads, momentum_bufs, scalars, *, nesterov, first_step, found_inf=None,
             checked=False):
    """One SGD step, in place on params and momentum_bufs.

    params/momentum_bufs: lists of C-contiguous arrays of one dtype, float32 or float64 (also the
    compute dtype); grads: same shapes, the params' dtype or bfloat16/float16. momentum_bufs is
    None without momentum; on the first step its contents are ignored and it is set to the
    gradient. `scalars`: `sgd_scalars(...)`, or (GPU) a float64 device vector holding them.
    `found_inf`: a float32 device scalar; when non-zero (dynamic loss scaling found a non-finite
    gradient) nothing is updated; `checked`: see `check_optimizer_lists`. On the GPU one kernel
    launch updates the whole list.
    """
    if not (params and is_device_array(params[0])):
        sgd_step_numpy(params, grads, momentum_bufs, scalars, nesterov=nesterov,
                       first_step=first_step, found_inf=found_inf)
        return
    param_dtype, grad_dtype = _check(params, grads, momentum_bufs, checked)
    if not is_device_array(scalars):
        scalars = xp.asarray(numpy.asarray(scalars, dtype=numpy.float64))
    lists = [params, grads] if momentum_bufs is None else [params, grads, momentum_bufs]
    table = tensor_table(lists)
    if table.num_blocks == 0:
        return
    bufs_row = table.rows[-1]   # the params' row without momentum: never read then
    kernel = get_kernel("sgd.cu", f"sgd_{dtype_suffix(param_dtype)}_{dtype_suffix(grad_dtype)}")
    kernel((table.num_blocks,), (THREADS,),
           (table.rows[0], table.rows[1], bufs_row, table.blocks, scalars,
            numpy.int32(nesterov), numpy.int32(first_step), nullable(found_inf, numpy.float32)))


def _check(params, grads, momentum_bufs, checked=False):
    """(param dtype, grad dtype), or None for empty lists."""
    states = {"momentum_bufs": momentum_bufs} if momentum_bufs is not None else {}
    return check_optimizer_lists(params, grads, checked=checked, **states)


def sgd_step_numpy(params, grads, momentum_bufs, scalars, *, nesterov, first_step,
                   found_inf=None):
    """NumPy twin of `sgd_step`."""
    dtypes = _check(params, grads, momentum_bufs)
    if dtypes is None or (found_inf is not None and found_inf.reshape(-1)[0] != 0):
        return
    lr, momentum, one_minus_dampening, weight_decay = (
        dtypes[0].type(value) for value in numpy.asarray(scalars, dtype=numpy.float64)[:4])
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.astype(p.dtype)
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum_bufs is not None:
            buf = momentum_bufs[i]
            buf[...] = g if first_step else momentum * buf + one_minus_dampening * g
            g = g + momentum * buf if nesterov else buf
        p -= lr * g
