"""Fused multi-tensor SGD with torch.optim.SGD semantics: `sgd.cu` for CuPy arrays (one launch for
the whole list), a NumPy twin otherwise.

Per element:
    g = g + wd p                                        (if wd != 0)
    buf = g on the first step, else momentum buf + (1 - dampening) g   (if momentum != 0)
    g = g + momentum buf if nesterov, else buf          (if momentum != 0)
    p = p - lr g
No maximize.
"""
import numpy

from cupytp.kernels import dtype_suffix, get_kernel, is_device_array
from cupytp.kernels.multi_tensor import THREADS, check_optimizer_lists, tensor_table


def sgd_step(params, grads, momentum_bufs, *, lr, momentum, dampening, nesterov, weight_decay,
             first_step):
    """One SGD step, in place on params and (when momentum != 0) momentum_bufs.

    params/momentum_bufs: lists of C-contiguous arrays of one dtype, float32 or float64 (also the
    compute dtype); grads: same shapes, the params' dtype or bfloat16/float16. momentum_bufs is
    ignored (may be None) when momentum == 0; on the first step its contents are ignored and it is
    set to the gradient. On the GPU one kernel launch updates the whole list.
    """
    if not (params and is_device_array(params[0])):
        sgd_step_numpy(params, grads, momentum_bufs, lr=lr, momentum=momentum,
                       dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
                       first_step=first_step)
        return
    param_dtype, grad_dtype = _check(params, grads, momentum_bufs, momentum, dampening, nesterov)
    lists = [params, grads, momentum_bufs] if momentum != 0 else [params, grads]
    table = tensor_table(lists)
    if table.num_blocks == 0:
        return
    bufs_row = table.rows[-1] if momentum != 0 else table.rows[0]  # not read when momentum == 0
    scalars = _scalars(param_dtype, lr, momentum, dampening, weight_decay)
    kernel = get_kernel("sgd.cu", f"sgd_{dtype_suffix(param_dtype)}_{dtype_suffix(grad_dtype)}")
    kernel((table.num_blocks,), (THREADS,),
           (table.rows[0], table.rows[1], bufs_row, table.blocks, *scalars,
            numpy.int32(nesterov), numpy.int32(first_step)))


def _check(params, grads, momentum_bufs, momentum, dampening, nesterov):
    """(param dtype, grad dtype), or None for empty lists; raises ValueError as torch does."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0")
    if momentum != 0 and momentum_bufs is None:
        raise ValueError(f"momentum={momentum} needs momentum_bufs")
    states = {"momentum_bufs": momentum_bufs} if momentum != 0 else {}
    return check_optimizer_lists(params, grads, **states)


def _scalars(dtype, lr, momentum, dampening, weight_decay):
    """The kernel's scalar arguments rounded to the params' dtype: lr, momentum, 1 - dampening,
    weight_decay."""
    return tuple(dtype.type(value) for value in (lr, momentum, 1 - dampening, weight_decay))


def sgd_step_numpy(params, grads, momentum_bufs, *, lr, momentum, dampening, nesterov,
                   weight_decay, first_step):
    """NumPy twin of `sgd_step`."""
    dtypes = _check(params, grads, momentum_bufs, momentum, dampening, nesterov)
    if dtypes is None:
        return
    lr, momentum, one_minus_dampening, weight_decay = _scalars(dtypes[0], lr, momentum,
                                                                dampening, weight_decay)
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.astype(p.dtype)
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            buf = momentum_bufs[i]
            buf[...] = g if first_step else momentum * buf + one_minus_dampening * g
            g = g + momentum * buf if nesterov else buf
        p -= lr * g
