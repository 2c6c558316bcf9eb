"""Elementwise ops with NumPy broadcasting.

Rule, per mesh dimension: inputs sharded on one output dimension make the output sharded there
(Replicated inputs covering that dimension are sliced, broadcast ones stay whole); no shard and
all Replicated gives Replicated; Partial passes through an op only where the op is linear in it
(P+P, P*R, P/R, -P, a P cast), else it is reduced first.
"""
import numbers

import numpy

from cupytp.ops.conversion import (
    DTensor, Partial, Replicated, Shard, backend, cached, convert, engine, fail, is_tensor,
    linear_grad, make, same_mesh, scalar_or_tensor)
from cupytp.launchers import bias_add, cast, is_device_array
from cupytp.ops.reduction import leading_sum_placements

LINEAR_JOINTLY = "jointly"      # add, sub: P op P is P, nothing else
LINEAR_EACH = "each"            # mul: exactly one Partial factor
LINEAR_FIRST = "first"          # div: Partial numerator only
NONLINEAR = "none"


def _partial_ok(linear, operands, placements):
    partial = [isinstance(p, Partial) and p.op == "sum" for p in placements]
    tensors = [x for x in operands if is_tensor(x)]
    if not any(partial) or any(isinstance(p, Partial) and p.op != "sum" for p in placements):
        return False
    if linear == LINEAR_JOINTLY:
        return len(tensors) == len(operands) and all(partial)
    if linear == LINEAR_EACH:
        return sum(partial) == 1
    if linear == LINEAR_FIRST:
        return is_tensor(operands[0]) and partial[0] and sum(partial) == 1
    return False


def elementwise_rule(op, operands, out_shape, linear):
    """(placements each tensor operand must have, output placements)."""
    tensors = [x for x in operands if is_tensor(x)]
    mesh = tensors[0].mesh
    out_ndim = len(out_shape)
    targets = [list(t.placements) for t in tensors]
    out = []
    for dim in range(mesh.ndim):
        placements = [t.placements[dim] for t in tensors]
        shard_dims = set()
        for t, p in zip(tensors, placements):
            if isinstance(p, Shard):
                if t.shape[p.dim] != out_shape[p.dim + out_ndim - t.ndim]:
                    fail(op, tensors, f"{t.shape} is sharded on broadcast dimension {p.dim}",
                         "Redistribute that input to Replicated.")
                shard_dims.add(p.dim + out_ndim - t.ndim)
        if len(shard_dims) > 1:
            fail(op, tensors, f"inputs are sharded on different dimensions {sorted(shard_dims)} "
                 f"of mesh dimension {dim}", "Redistribute them to the same Shard first.")
        if shard_dims:
            out_dim = shard_dims.pop()
            for t, target in zip(tensors, targets):
                own = out_dim - (out_ndim - t.ndim)
                covers = own >= 0 and t.shape[own] == out_shape[out_dim]
                target[dim] = Shard(own) if covers else Replicated()
            out.append(Shard(out_dim))
        elif _partial_ok(linear, operands, placements):
            out.append(Partial("sum"))
        else:
            for target in targets:
                target[dim] = Replicated()
            out.append(Replicated())
    return targets, tuple(out)


def _layout_rule(op, operands, linear):
    """(input placements per tensor operand, output shape, output placements)."""
    out_shape = numpy.broadcast_shapes(*[t.shape for t in operands if is_tensor(t)])
    targets, out_placements = elementwise_rule(op, operands, out_shape, linear)
    return [tuple(t) for t in targets], tuple(out_shape), out_placements


def laid_out(op, operands, linear):
    """(the operands converted as the elementwise rule asks, the mesh, the output's shape and
    placements): numbers become tensors, Partial inputs are reduced where the op is not
    `linear` in them, Replicated ones sliced to the output's shards."""
    tensors = [x for x in operands if isinstance(x, DTensor)]
    if len(tensors) < len(operands):
        operands = [scalar_or_tensor(op, x) for x in operands]
    same_mesh(op, tensors)
    signature = tuple([(x.shape, x.placements) if isinstance(x, DTensor) else None
                       for x in operands])
    targets, out_shape, out_placements = cached((_layout_rule, linear, signature), _layout_rule,
                                                op, operands, linear)
    if any([t.placements != p for t, p in zip(tensors, targets)]):
        converted = iter([convert(op, t, p, tensors) for t, p in zip(tensors, targets)])
        operands = [next(converted) if isinstance(x, DTensor) else x for x in operands]
    return operands, tensors[0].mesh, out_shape, out_placements


def apply(op, fn, operands, linear, backward_fn=None, saves=True):
    """Run elementwise `fn` on the local arrays of `operands` (DTensors and numbers);
    `backward_fn(g, *operands, out)` gives the input gradients. With `saves=False` (ops whose
    gradient needs no values: add, sub, neg, astype) it gets None for each of them, so the tape
    keeps neither the inputs nor the output alive."""
    operands, mesh, out_shape, out_placements = laid_out(op, operands, linear)
    local = fn(*[x._local if isinstance(x, DTensor) else x for x in operands])
    out = make(local, mesh, out_shape, out_placements)
    if backward_fn is None:
        return out
    inputs = [x if is_tensor(x) else None for x in operands]
    if not saves:
        unsaved = (None,) * (len(operands) + 1)
        return engine.record(out, inputs, lambda g: backward_fn(g, *unsaved), op)
    return engine.record(out, inputs, lambda g: backward_fn(g, *operands, out), op)


# ---- binary -------------------------------------------------------------------------------------
def add(a, b):
    return apply("add", add_local, [a, b], LINEAR_JOINTLY, lambda g, a, b, out: (g, g),
                 saves=False)


def add_local(x, y):
    """x + y; a bias over the trailing dimensions of a GPU array (a linear layer's (C,), the
    q|k|v projection's (3, C)) goes through the bias_add kernel (the same sum, without CuPy's
    broadcast indexing)."""
    for big, small in ((x, y), (y, x)):
        if is_device_array(big) and is_device_array(small) and 0 < small.ndim < big.ndim and \
                big.shape[big.ndim - small.ndim:] == small.shape and backend.c_contiguous(big) \
                and backend.c_contiguous(small):
            rows, flat = big.reshape(-1, small.size), small.reshape(-1)
            if bias_add.applies(rows, flat):
                return bias_add.bias_add(rows, flat).reshape(big.shape)
    return x + y


def bias_residual_add(y, bias, residual):
    """`residual + (y + bias)`, bias (C,) along y's last dimension: a row-parallel layer's output
    (Partial: all-reduced first), its bias and the residual stream in one pass. On a GPU, a
    16-bit y with a bias and residual of its compute dtype (autocast's fp32 master bias and
    residual stream) take one kernel and no 16-bit rounding of y + bias."""
    if bias.ndim != 1 or bias.shape[0] != y.shape[-1]:
        raise ValueError(f"bias_residual_add: bias must have shape ({y.shape[-1]},) (y's last "
                         f"dimension), got {bias.shape}")
    return apply("bias_residual_add", bias_residual_local, [residual, y, bias], LINEAR_JOINTLY,
                 lambda g, residual, y, bias, out: (g, g, g), saves=False)


def bias_residual_local(residual, y, bias):
    if bias_add.residual_applies(y, bias, residual):
        return bias_add.bias_residual_add(y, bias, residual)
    return residual + (y + bias)


def sub(a, b):
    return apply("sub", lambda x, y: x - y, [a, b], LINEAR_JOINTLY,
                 lambda g, a, b, out: (g, neg(g)), saves=False)


def _wants_grad(x):
    return is_tensor(x) and x.requires_grad


def mul(a, b):
    return apply("mul", lambda x, y: x * y, [a, b], LINEAR_EACH,
                 lambda g, a, b, out: (mul(g, b) if _wants_grad(a) else None,
                                       mul(g, a) if _wants_grad(b) else None))


def div(a, b):
    def backward(g, a, b, out):
        grad_a = div(g, b) if _wants_grad(a) else None
        grad_b = neg(div(mul(g, out), b)) if _wants_grad(b) else None
        return grad_a, grad_b
    return apply("div", lambda x, y: x / y, [a, b], LINEAR_FIRST, backward)


# ---- unary --------------------------------------------------------------------------------------
def neg(x):
    return apply("neg", lambda v: -v, [x], LINEAR_EACH, lambda g, x, out: (neg(g),))


def pow(x, exponent):
    if not isinstance(exponent, numbers.Number):
        raise TypeError("pow: the exponent must be a Python number")
    return apply("pow", lambda v: v ** exponent, [x], NONLINEAR,
                 lambda g, x, out: (mul(g, mul(pow(x, exponent - 1), exponent)),))


def exp(x):
    return apply("exp", backend.xp.exp, [x], NONLINEAR, lambda g, x, out: (mul(g, out),))


def log(x):
    return apply("log", backend.xp.log, [x], NONLINEAR, lambda g, x, out: (div(g, x),))


def sqrt(x):
    return apply("sqrt", backend.xp.sqrt, [x], NONLINEAR,
                 lambda g, x, out: (div(g, mul(out, 2.0)),))


def tanh(x):
    return apply("tanh", backend.xp.tanh, [x], NONLINEAR,
                 lambda g, x, out: (mul(g, sub(1.0, mul(out, out))),))


def gelu(x):
    """GeLU, tanh form (GPT-2), through the fused kernel on GPU."""
    from cupytp.launchers.gelu import gelu as gelu_local, gelu_backward

    def backward(g, x, out):
        g = linear_grad(g, out.placements)
        xp = backend.xp
        local = gelu_backward(xp.ascontiguousarray(x._local), xp.ascontiguousarray(g._local))
        return (make(local, x.mesh, x.shape, g.placements),)
    return apply("gelu", lambda v: gelu_local(backend.xp.ascontiguousarray(v)), [x], NONLINEAR,
                 backward)


def bias_gelu(x, bias):
    """gelu(x + bias), bias (H,) along x's last dimension, laid out like it (column-parallel:
    x (..., H/tp) Shard(-1), bias Shard(0)); one fused kernel each way on GPU. The bias gradient
    is the kernel's column sum: Partial where x's leading dims are sharded."""
    from cupytp.launchers.gelu import bias_gelu as forward, bias_gelu_backward
    if bias.ndim != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias_gelu: bias must have shape ({x.shape[-1]},) (x's last "
                         f"dimension), got {bias.shape}")
    xp = backend.xp

    def backward(g, x, bias, out):
        g = linear_grad(g, out.placements)
        dx, dbias = bias_gelu_backward(xp.ascontiguousarray(x._local),
                                       xp.ascontiguousarray(bias._local),
                                       xp.ascontiguousarray(g._local, dtype=x.dtype))
        return (make(dx, x.mesh, x.shape, g.placements),
                make(dbias.astype(bias.dtype, copy=False), bias.mesh, bias.shape,
                     leading_sum_placements(g.placements, x.ndim)))
    return apply("bias_gelu", lambda v, b: forward(xp.ascontiguousarray(v),
                                                    xp.ascontiguousarray(b)),
                 [x, bias], NONLINEAR, backward)


def silu_mul(h):
    """silu(h[..., 0, :]) * h[..., 1, :] for h (..., 2, F): the gate of a SwiGLU MLP over one
    gate|up product's output, (..., F); one kernel each way on GPU (`kernels/swiglu.cu`). h may
    be sharded on any dimension but the pair (-2): column-parallel, F/tp per rank."""
    from cupytp.launchers.swiglu import swiglu, swiglu_backward
    if h.ndim < 2 or h.shape[-2] != 2:
        raise ValueError(f"silu_mul takes gate and up side by side, (..., 2, F); got {h.shape}")
    pair = Shard(h.ndim - 2)
    h = convert("silu_mul", h, tuple(Replicated() if p == pair or p.is_partial() else p
                                     for p in h.placements), [h])   # errs where that gathers
    xp = backend.xp
    h_local = xp.ascontiguousarray(h._local)
    placements = tuple(Shard(p.dim - 1) if isinstance(p, Shard) and p.dim == h.ndim - 1 else p
                       for p in h.placements)
    layout = h.layout
    out = make(swiglu(h_local), layout.mesh, h.shape[:-2] + h.shape[-1:], placements)

    def backward(g):
        g = linear_grad(g, out.placements)
        dh = swiglu_backward(h_local, xp.ascontiguousarray(g._local, dtype=h_local.dtype))
        grad_placements = tuple(Shard(p.dim + 1) if isinstance(p, Shard) and
                                p.dim == layout.ndim - 2 else p for p in g.placements)
        return (make(dh, layout.mesh, layout.shape, grad_placements),)
    return engine.record(out, (h,), backward, "silu_mul")


def astype(x, dtype):
    """`x` cast to `dtype`; the gradient is cast back."""
    dtype = backend.dtype(dtype)
    if x.dtype == dtype:
        return x
    source = x.dtype
    return apply("astype", lambda v: cast.converted(v, dtype), [x], LINEAR_EACH,
                 lambda g, x, out: (astype(g, source),), saves=False)


def masked_fill(x, mask, value):
    """`x` with `value` where the boolean DTensor `mask` (broadcast to x) is true."""
    def fill(v, m):
        return backend.xp.where(m, v.dtype.type(value), v)   # a scalar: no copy to the device

    def backward(g, x, mask, out):
        return (masked_fill(g, mask, 0.0), None)
    return apply("masked_fill", fill, [x, mask], NONLINEAR, backward)

