"""Fused sublayers of a pre-LayerNorm transformer block: one op and one tape node each, for what
is otherwise a chain of five to nine ops.

    mlp_residual(x, residual, fc_weight, fc_bias, proj_weight, proj_bias, norm=None,
                 dropout_p=0.0)
        = residual + dropout(gelu(x @ fc_weight + fc_bias) @ proj_weight + proj_bias)
    attention_residual(x, residual, qkv_weight, qkv_bias, proj_weight, proj_bias, num_heads,
                       dropout_p=0.0, norm=None, resid_dropout_p=0.0)
        = residual + dropout(attention(x · qkv_weight + qkv_bias) @ proj_weight + proj_bias)

Every bias may be None (a layer without one). With `norm=(weight, bias, eps)` the sublayer reads
layer_norm(x, weight, bias, eps) instead of x: the block's LayerNorm joins the op (its kernels
run in it, with no node, tensors or layouts of its own), and when x is the residual, as in a
pre-LayerNorm block, the residual's gradient is added to x's inside the LayerNorm's backward
kernel.

A fused op runs the local math of the chain it replaces for the host work of one op (a step of a
small model is host-bound, and every op of a chain costs its own sharding rule, tensors and tape
node), with the biases, the GeLU, the residual addition and the bias gradients as epilogues of the
products (`launchers.gemm_epilogue`): each product is rounded once, after its epilogue, where the
chain rounds it before, so the two agree to the products' rounding, not bit for bit. With
dropout on the projection's output (`dropout_p`, `resid_dropout_p`), the product is written and
one kernel adds its bias, draws, applies and scales the dropout and adds the residual
(`launchers.dropout`, the chain's `bias_dropout_add`): the same mask as the chain's, and a 1-bit
mask kept for the backward. Under `no_grad` (nothing requires a gradient) nothing is kept for a
backward: no GeLU pre-activation, LayerNorm statistics or dropout mask is written.

The layouts it takes, per mesh dimension (worked out once per layout signature):
- tensor-parallel (Megatron's pair), at most one such dimension: fc_weight Shard(1) and fc_bias
  Shard(0), or qkv_weight Shard(2) and qkv_bias Shard(1) (whole heads); proj_weight Shard(0),
  proj_bias Replicated; x and residual Replicated. The projection is all-reduced in forward, and
  x's gradient in backward, on the communication stream while the first weight's gradient is
  computed.
- data-parallel or dense: every parameter Replicated, x and residual both Replicated or both
  sharded on the batch (Shard(0)); the parameters' gradients are Partial there.
The LayerNorm's weight and bias (the same mesh, shape (C,)) are Replicated on every mesh dim.
Any other layout, attention the flash kernels do not take, or dropout on a residual of another
dtype than the products' (or their compute dtype) runs the chain of ops, as does everything
inside `fusion(False)` (or with CUPYTP_FUSED=0).
"""
import weakref
from contextlib import contextmanager

import numpy

from cupytp import env
from cupytp.launchers import compute_dtype, cudnn_attention, dropout as dropouts, flash_attention
from cupytp.launchers.cast import converted
from cupytp.launchers.column_sum import column_sum_and_cast
from cupytp.launchers.gemm_epilogue import (
    matmul_bias, matmul_bias_gelu, matmul_bias_grad, matmul_gelu_grad)
from cupytp.launchers.layernorm import layer_norm_backward, layer_norm_forward
from cupytp.ops.amp import autocast_local, autocast_operand, operand_dtype
from cupytp.ops.conversion import (
    Layout, Partial, Replicated, Shard, backend, cached, engine, linear_grad, make)
from cupytp.ops.elementwise import bias_gelu, bias_residual_local, gelu
from cupytp.ops.functional import (
    attention_setup, bias_dropout_add, layer_norm, packed_attention, unpacked)
from cupytp.ops.linalg import einsum, local_einsum, matmul
from cupytp.tensor.random import default_generator
from cupytp.tensor.redistribute import redistribute_local

_enabled = env.get("CUPYTP_FUSED")

# the tensor-parallel placements of (first weight, its bias, proj_weight, proj_bias)
MLP_SPLIT = (Shard(1), Shard(0), Shard(0), Replicated())
ATTENTION_SPLIT = (Shard(2), Shard(1), Shard(0), Replicated())


@contextmanager
def fusion(enabled=True):
    """Inside `fusion(False)` the fused ops run their chains of ops (to compare, or debug)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def _plan(split, x, residual, params, norm, dropout, extra=()):
    """(tensor-parallel mesh dim or None, the gradient placements of the parameters and then of
    the norm's weight and bias) when the fused form takes these inputs (parameters None where
    absent; `dropout`: whether the projection's output has dropout), else None."""
    if not _enabled:
        return None
    norms = () if norm is None else tuple(p for p in norm[:2] if p is not None)
    key = (split, x.shape, x.placements, id(x.mesh), residual.shape, residual.placements,
           id(residual.mesh), operand_dtype(x), residual.dtype, dropout, extra,
           None if norm is None else (norm[0] is None, norm[1] is None),
           *[None if p is None else (p.shape, p.placements, id(p.mesh), operand_dtype(p))
             for p in params + norms])
    return cached(key, _layouts, split, x, residual, params, norms, dropout) or None


def _layouts(split, x, residual, params, norms, dropout):
    mesh = x.mesh
    given = [p for p in params if p is not None]
    same = residual.mesh == mesh and all(p.mesh == mesh for p in given + list(norms))
    dtypes = {operand_dtype(t) for t in (x, params[0], params[2])}
    if not same or x.shape != residual.shape or x.ndim != 3 or len(dtypes) > 1 or \
            any(p.shape != x.shape[-1:] for p in norms):
        return False
    if norms and x.dtype not in (operand_dtype(x), numpy.float32):
        return False            # the norm's kernels give x's dtype, or 16 bits from float32
    if dropout and not dropouts.applies(operand_dtype(x), None, residual.dtype):
        return False            # the dropout kernel's output is the residual's dtype
    tp, grads, norm_grads = None, [[] for _ in params], [[] for _ in norms]
    for dim, (px, pr) in enumerate(zip(x.placements, residual.placements)):
        own = tuple(None if p is None else p.placements[dim] for p in params)
        if any(p.placements[dim] != Replicated() for p in norms):
            return False
        if all(o in (None, s) for o, s in zip(own, split)) and px == pr == Replicated() and \
                tp is None:
            tp = dim
            for grad, placement in zip(grads, split):
                grad.append(placement)
            for grad in norm_grads:     # x's gradient is all-reduced before the norm's backward
                grad.append(Replicated())
        elif all(p in (None, Replicated()) for p in own) and px == pr and \
                px in (Replicated(), Shard(0)):
            for grad in grads + norm_grads:
                grad.append(Partial() if px == Shard(0) else Replicated())
        else:
            return False
    return tp, tuple(tuple(grad) for grad in grads + norm_grads)


class _Norm:
    """The LayerNorm a fused sublayer reads its input through (`norm=(weight, bias, eps)`): its
    forward on x's local array when made (`out`, in the products' dtype), its backward from the
    gradient of `out` in `backward`. Keeps x's local array (the residual stream) and the rows'
    mean and rstd; the backward makes xhat again from them."""

    def __init__(self, x, norm, saved):
        weight, bias, eps = norm
        self.given = (weight, bias)
        self.params = tuple(p for p in self.given if p is not None)
        self.dtype, xp = x.dtype, backend.xp
        self.weight, bias_local = (None if p is None else p._local.astype(x.dtype, copy=False)
                                   for p in (weight, bias))
        self.x = xp.ascontiguousarray(x._local)
        self.out, self.mean, self.rstd = layer_norm_forward(
            self.x, self.weight, bias_local, eps, operand_dtype(x), saved)

    def backward(self, g, add, cast=None):
        """(x's gradient, plus `add` (x's dtype, or None), then the gradients of the weight and
        bias given) from g, the gradient of `out`; with `cast` (see `_cast_wanted`), then the
        (cast, column sums) of x's gradient."""
        dx, *sums = layer_norm_backward(g.reshape(self.x.shape), self.x, self.mean, self.rstd,
                                        self.weight, self.dtype, add, param_grads=True,
                                        cast=cast)
        made = (sums.pop(),) if cast is not None else ()
        return (dx, *[grad.astype(p.dtype, copy=False) for grad, p in zip(sums, self.given)
                      if p is not None], *made)


def _input(x, norm, saved):
    """(the local array the first product reads, the _Norm or None): x's (autocast's cast of
    it), or the output of the LayerNorm `norm` over x (its statistics kept when `saved`)."""
    if norm is None:
        return autocast_local(x), None
    normed = _Norm(x, norm, saved)
    return normed.out, normed


def _reduces(tp, mesh):
    """True when a Partial sum along mesh dim `tp` must move data (more than one rank)."""
    return tp is not None and mesh.shape[tp] > 1


def _all_reduced(local, tp, layout, async_op=False):
    """`local`, a Partial sum along mesh dim `tp` of a value laid out as `layout`, all-reduced
    there; with `async_op`, a Work whose wait() gives it."""
    partial = layout.placements[:tp] + (Partial(),) + layout.placements[tp + 1:]
    return redistribute_local(local, Layout.trusted(layout.mesh, layout.shape, partial),
                              layout.placements, async_op)[0]


def _rows(v):
    """v (..., C) as a (rows, C) matrix."""
    return v.reshape(-1, v.shape[-1])


def _project(a, w, bias, residual, tp, dropout):
    """(residual + dropout(a @ w + bias) on local arrays, a (rows, K), and the dropout's mask or
    None): without dropout one product with the bias and the residual as its epilogue, or,
    where the product is all-reduced along `tp` first (or the dtypes do not fit the epilogue),
    the product and then one bias-and-residual pass; with dropout (a `_Dropout`) the product
    (all-reduced) and then one pass of bias, dropout and residual."""
    res, b = residual._local, None if bias is None else bias._local
    if dropout is None and not _reduces(tp, residual.mesh) and \
            (b is None or b.dtype == res.dtype) and res.dtype in (a.dtype, compute_dtype(a.dtype)):
        return matmul_bias(a, w, b, _rows(res)).reshape(res.shape), None
    y = local_einsum("xy", "yz", "xz", a, w).reshape(res.shape[:-1] + (w.shape[-1],))
    if _reduces(tp, residual.mesh):
        y = _all_reduced(y, tp, residual.layout)
    if dropout is not None:
        xp = backend.xp
        b = None if b is None else xp.ascontiguousarray(b if b.dtype == res.dtype else
                                                        converted(b, res.dtype))
        return dropouts.dropout(y, dropout.p, dropout.counters, b, xp.ascontiguousarray(res),
                                keep_mask=dropout.saved)
    return (res + y if b is None else bias_residual_local(res, y, b)), None


def _projected(a, w, bias, residual, tp, dropout):
    """(the sublayer's output residual + dropout(a @ w + bias) as a DTensor laid out as the
    residual, the dropout's mask or None): `_project` on the local arrays."""
    local, mask = _project(a, w, bias, residual, tp, dropout)
    return make(local, residual.mesh, residual.shape, residual.placements), mask


def _projected_grads(g, drop, mask, dtype, bias):
    """(the gradient of the product in `dtype`, the bias's or None) from the output's gradient
    g: through the dropout's backward where the output has a dropout."""
    if drop is None:
        return _grad_and_bias_grad(g, dtype, bias)
    return drop.backward(g, mask, dtype, bias)


class _Dropout:
    """The dropout of a fused sublayer's output: p, the counters of its draw over the residual's
    block, whether its mask is kept (a backward follows)."""
    __slots__ = ("p", "counters", "saved")

    def __init__(self, p, generator, residual, saved):
        self.p, self.saved = p, saved
        self.counters = (generator or default_generator).counters(
            residual.shape, *residual.layout.local_block())

    @staticmethod
    def of(p, generator, residual, saved):
        """The _Dropout of probability p (None for p = 0)."""
        return _Dropout(p, generator, residual, saved) if p > 0 else None

    def backward(self, g, mask, dtype, bias=None):
        """(the gradient of the product (rows, C) in `dtype` from the output's g, the bias's
        gradient or None): where `_sums_with_cast` allows, the dropout's backward, the cast and
        the bias's sums are one pass (`column_sum_and_cast` with the mask); else None, and the
        weight's product sums them."""
        g = backend.xp.ascontiguousarray(g)
        if _sums_with_cast(g.dtype, dtype, bias):
            sums, copy = column_sum_and_cast(_rows(g), dtype, bias.dtype, mask, self.p)
            return copy, sums
        return _rows(dropouts.dropout_backward(g, mask, self.p, dtype)), None


def _weight_grads(x, g, weight, bias, bias_grad=None):
    """(the weight's gradient, the bias's; None where not needed) of x @ w + bias given the
    output's gradient g: x (rows, K), g (rows, N); one product with the bias's gradient as its
    epilogue, or, where `bias_grad` was summed already (`_grad_and_bias_grad`), the product
    alone."""
    if bias_grad is not None:
        return (local_einsum("xy", "xz", "yz", x, g, weight.dtype) if weight.requires_grad
                else None), bias_grad.astype(bias.dtype, copy=False)
    if bias is not None and bias.requires_grad:
        gw, gb = matmul_bias_grad(x.T, g, weight.dtype)
        return (gw if weight.requires_grad else None), gb.astype(bias.dtype, copy=False)
    if not weight.requires_grad:
        return None, None
    return local_einsum("xy", "xz", "yz", x, g, weight.dtype), None


def _input_grad(g, w, x):
    """A function giving x's local gradient through the first product x_local @ w, from its
    output's gradient g (rows, N); `x`: (requires a gradient?, dtype, layout, tp) of the input
    (None where none is needed). Where tensor parallelism splits the product, x's gradient is
    all-reduced along `tp`: started here, waited for when the function is called, so that the
    weights' products run meanwhile."""
    needed, dtype, layout, tp = x
    if not needed:
        return lambda: None
    gx = local_einsum("xz", "yz", "xy", g, w.reshape(w.shape[0], -1), dtype)
    return _reduced_later(gx.reshape(layout.local_shape), layout, tp)


def _reduced_later(gx, layout, tp):
    """A function giving x's local gradient gx, all-reduced along `tp` where that dim has more
    than one rank: the all-reduce starts now, on the communication stream, and is waited for
    when the function is called."""
    if not _reduces(tp, layout.mesh):
        return lambda: gx
    return _all_reduced(gx, tp, layout, async_op=True).wait


def _grad_as(g, dtype):
    """The output's gradient g (local) as a (rows, C) matrix of the products' dtype (the cast
    the norm backward that made g gave with it, where there is one)."""
    given = _given_cast(g, dtype, False)
    if given is not None:
        return _rows(given[0])
    return _rows(g if g.dtype == dtype else converted(g, dtype))


def _grad_and_bias_grad(g, dtype, bias):
    """(`_grad_as(g, dtype)`, the bias's gradient or None): where a float32 g is cast to a
    16-bit dtype, the cast's pass sums its columns too (cuBLASLt's bias-gradient epilogue runs a
    reduction kernel of its own after the product), or the norm backward that made g did both;
    else None, and the weight's product sums them (`_weight_grads`)."""
    if not _sums_with_cast(g.dtype, dtype, bias) or not backend.c_contiguous(g):
        return _grad_as(g, dtype), None
    given = _given_cast(g, dtype, True)
    if given is not None:
        return _rows(given[0]), given[1].astype(bias.dtype, copy=False)
    return column_sum_and_cast(_rows(g), dtype, bias.dtype)[::-1]


def _sums_with_cast(g_dtype, dtype, bias):
    """True when a float32 gradient cast to the 16-bit `dtype` also gives `bias`'s gradient."""
    return bias is not None and bias.requires_grad and g_dtype == numpy.float32 and \
        numpy.dtype(dtype).itemsize == 2


# ---- a sublayer's output gradient in its products' dtype, made by the next norm's backward -----
# A fused sublayer's backward reads its output's float32 gradient once more to cast it (and sum
# its columns for its bias); the fused sublayer after it, whose norm's backward writes that
# gradient (summing in the residual's), writes the cast (and the sums) in the same pass instead.
# The first asks for it in its forward (`_cast_wanted`), the second hands it over with the
# gradient array it belongs to (`_give_cast`), the first takes it if its gradient is that array.
_wanted_casts = {}      # id(output) -> (weak ref to the output, (dtype, with_sum))
_given_casts = {}       # id(gradient array) -> (the array, its cast, its column sums or None)


def _want_cast(out, dtype, bias):
    """Note that the backward of the fused sublayer that made `out` reads out's gradient in
    `dtype`, summing its columns for `bias` (None: no bias); nothing where that is out's own
    dtype."""
    if numpy.dtype(dtype) == out.dtype:
        return
    key = id(out)

    def forget(ref):
        if _wanted_casts.get(key, (None,))[0] is ref:
            del _wanted_casts[key]
    _wanted_casts[key] = (weakref.ref(out, forget),
                          (numpy.dtype(dtype), _sums_with_cast(out.dtype, dtype, bias)))


def _cast_wanted(x):
    """The (dtype, with_sum) in which x's maker reads x's gradient, or None."""
    entry = _wanted_casts.get(id(x))
    return entry[1] if entry is not None and entry[0]() is x else None


def _give_cast(gradient, made):
    """Hand `made` (cast, column sums or None) over with the gradient array it was made from,
    until the end of this backward pass."""
    engine.queue_callback(_given_casts.clear, once=True)
    _given_casts[id(gradient)] = (gradient, *made)


def _given_cast(g, dtype, with_sum):
    """(cast, column sums) handed over with the gradient array g, if of `dtype` and with the
    sums where `with_sum`; None otherwise."""
    entry = _given_casts.get(id(g))
    if entry is None or entry[0] is not g or entry[1].dtype != dtype or \
            (with_sum and entry[2] is None):
        return None
    del _given_casts[id(g)]
    return entry[1], entry[2]


def _recorded(out, inputs, input_part, weight_part, name, placements, normed, grad_cast=None):
    """`out` with the fused node recorded. Its backward has two parts: `input_part(g)` gives,
    from the output's local gradient g, a function returning the first product's input
    gradient (None where none is needed; see `_input_grad`) and the state from which
    `weight_part(state)` gives the parameters' local gradients (None where not needed); the
    residual's gradient is the output's, and the norm's backward follows x's. A whole backward
    runs the weights' products while x's gradient is all-reduced; a split one (the node
    `splits`: ZB-H1's I and W) gives x's and the residual's gradients, and computes the norm's
    parameters' with them, when those are asked for, and runs the weights' products only when
    the parameters' gradients are. `placements`: the parameters' (and the norm's) gradient
    placements; `normed`: the _Norm in front, or None. The closure keeps layouts, not x or the
    residual (the residual stream is not held for backward). `grad_cast`: (dtype, bias) where
    `input_part` reads g in that dtype through `_grad_as` or `_grad_and_bias_grad`, so that the
    norm backward of the fused sublayer that reads `out` may make that cast (`_want_cast`)."""
    x, residual, *params = inputs
    x_layout, layout, residual_needed = x.layout, residual.layout, residual.requires_grad
    strict, joined, x_dtype = range(layout.mesh.ndim), x is residual, x.dtype
    norms = () if normed is None else normed.params
    if grad_cast is not None:
        _want_cast(out, *grad_cast)
    cast = _cast_wanted(x) if normed is not None and joined else None
    inputs = inputs + norms
    owed = []      # a split backward's later part: (its first part's gradients, the state)

    def first_part(g, gx):
        """[x's gradient, the residual's] and the norm's parameters' local gradients, from g
        and x's local gradient gx (before the norm's backward)."""
        g_residual, norm_grads = (g if residual_needed else None), []
        if normed is not None:
            add = g._local if joined and residual_needed and g.dtype == x_dtype and \
                backend.c_contiguous(g._local) else None
            wanted = cast if add is not None else None
            gx, *norm_grads = normed.backward(gx, add, wanted)
            if wanted is not None:
                _give_cast(gx, norm_grads.pop())
            g_residual = None if add is not None else g_residual
        gx = None if gx is None else make(gx, x_layout.mesh, x_layout.shape, x_layout.placements)
        return [gx, g_residual], norm_grads

    def made(weight_grads, norm_grads):
        return [None if local is None else make(local, p.mesh, p.shape, grad_placements)
                for local, p, grad_placements in zip(list(weight_grads) + norm_grads,
                                                     params + list(norms), placements)]

    def backward(g, needs=None):
        if owed:                                    # the parameters' part of a split backward
            (first, norm_grads), state = owed.pop()
            return (*first, *made(weight_part(state), norm_grads))
        g = linear_grad(g, layout.placements, strict=strict)
        gx_of, state = input_part(g._local)
        later = needs is not None and not any(needs[2:])
        weight_grads = None if later else weight_part(state)
        first = first_part(g, gx_of())
        if later:               # keep for later only what this call does not hand out
            unasked = [None if asked else grad for grad, asked in zip(first[0], needs)]
            owed.append(((unasked, first[1]), state))
            return (*first[0], *[None] * (len(params) + len(norms)))
        return (*first[0], *made(weight_grads, first[1]))
    return engine.record(out, inputs, backward, name, splits=True)


def mlp_residual(x, residual, fc_weight, fc_bias, proj_weight, proj_bias, norm=None,
                 dropout_p=0.0, generator=None):
    """residual + dropout(gelu(x @ fc_weight + fc_bias) @ proj_weight + proj_bias) for x and
    residual (B, T, C), fc_weight (C, H), proj_weight (H, C), either bias None or given: a GPT-2
    MLP, its dropout (probability `dropout_p`, from `generator`) and its residual addition,
    fused (module docstring), x first normalized by `norm` (weight, bias, eps) when given;
    inside `autocast` the products run in its dtype."""
    params = (fc_weight, fc_bias, proj_weight, proj_bias)
    plan = _plan(MLP_SPLIT, x, residual, params, norm, dropout_p > 0)
    if plan is None:
        x = x if norm is None else layer_norm(x, *norm)
        h = matmul(x, fc_weight, reduce_input_grad=True)                 # (B, T, H/tp)
        h = gelu(h) if fc_bias is None else bias_gelu(h, fc_bias)
        return bias_dropout_add(matmul(h, proj_weight), proj_bias, residual, dropout_p,
                                generator=generator)
    tp, placements = plan
    saved = engine.records((x, residual, *params) + (() if norm is None else norm[:2]))
    (x_local, normed), w1, w2 = _input(x, norm, saved), autocast_local(fc_weight), \
        autocast_local(proj_weight)
    b1 = _bias_as(fc_bias, x_local.dtype)
    u, pre = matmul_bias_gelu(_rows(x_local), w1, b1, saved)   # pre: x @ w1 + b1
    drop = _Dropout.of(dropout_p, generator, residual, saved)
    out, mask = _projected(u, w2, proj_bias, residual, tp, drop)
    if not saved:
        return out
    x_info = _input_info(x, x_local, normed, tp)

    def input_part(g):
        gy, gb2 = _projected_grads(g, drop, mask, u.dtype, proj_bias)
        needs_b1 = fc_bias is not None and fc_bias.requires_grad
        dh, gb1 = matmul_gelu_grad(gy, w2.T, pre, needs_b1)     # gb1 in dh's epilogue
        return _input_grad(dh, w1, x_info), (gy, gb2, dh, gb1)

    def weight_part(state):
        gy, gb2, dh, gb1 = state
        gw2, gb2 = _weight_grads(u, gy, proj_weight, proj_bias, gb2)
        gw1, _ = _weight_grads(_rows(x_local), dh, fc_weight, None)
        return gw1, gb1 if gb1 is None else gb1.astype(fc_bias.dtype, copy=False), gw2, gb2
    return _recorded(out, (x, residual, *params), input_part, weight_part, "mlp_residual",
                     placements, normed, None if drop is not None else (u.dtype, proj_bias))


def _input_info(x, x_local, normed, tp):
    """(is the first product's input gradient needed, its dtype, x's layout, the
    tensor-parallel mesh dim or None): with a norm in front, the gradient of the norm's output,
    in the products' dtype."""
    if normed is None:
        return x.requires_grad, x.dtype, x.layout, tp
    return True, x_local.dtype, x.layout, tp


def _bias_as(bias, dtype):
    """The local array of a bias (autocast's cast of it) as a contiguous array of the products'
    dtype (the epilogue adds one of the output's); None for None."""
    if bias is None:
        return None
    bias = autocast_local(bias)
    return backend.xp.ascontiguousarray(bias if bias.dtype == dtype else converted(bias, dtype))


def attention_residual(x, residual, qkv_weight, qkv_bias, proj_weight, proj_bias, num_heads,
                       dropout_p=0.0, generator=None, norm=None, resid_dropout_p=0.0):
    """residual + dropout(attention(x · qkv_weight + qkv_bias) @ proj_weight + proj_bias):
    causal multi-head self-attention over x and residual (B, T, C), qkv_weight (C, 3, C) with
    the heads on its last axis, qkv_bias (3, C) or None, proj_weight (C, C), proj_bias or None;
    attention dropout `dropout_p`, dropout `resid_dropout_p` on the projection's output (drawn
    after the attention's, from `generator`); x first normalized by `norm` (weight, bias, eps)
    when given. A GPT-2 attention and its residual addition, fused (module docstring)."""
    params = (qkv_weight, qkv_bias, proj_weight, proj_bias)
    b, t, c = x.shape
    d = c // num_heads
    flash = operand_dtype(x) in flash_attention.DTYPES and d in flash_attention.HEAD_DIMS \
        and c % num_heads == 0 and cudnn_attention.choice() != "matmul"
    plan = _plan(ATTENTION_SPLIT, x, residual, params, norm, resid_dropout_p > 0, num_heads) \
        if flash else None
    if plan is None:
        x = x if norm is None else layer_norm(x, *norm)
        qkv = einsum("btc,cjd->btjd", x, qkv_weight, reduce_input_grad=True)
        qkv = qkv if qkv_bias is None else qkv + autocast_operand(qkv_bias)
        y = packed_attention(qkv.reshape(b, t, 3, num_heads, d), True, dropout_p, generator)
        return bias_dropout_add(matmul(y.reshape(b, t, c), proj_weight), proj_bias, residual,
                                resid_dropout_p, generator=generator)
    tp, placements = plan
    saved = engine.records((x, residual, *params) + (() if norm is None else norm[:2]))
    (x_local, normed), wq, wp = _input(x, norm, saved), autocast_local(qkv_weight), \
        autocast_local(proj_weight)
    bq = _bias_as(qkv_bias, x_local.dtype)
    qkv = matmul_bias(_rows(x_local), wq.reshape(wq.shape[0], -1),
                      None if bq is None else bq.reshape(-1))           # (B T, 3 C/tp)
    rows, heads = x_local.shape[0], qkv.shape[-1] // (3 * d)            # this rank's batch, heads
    views = unpacked(qkv.reshape(rows, t, 3, heads, d))
    kernels, scale, attention_drop = attention_setup(
        views[0], views[1], dropout_p, generator, (b, num_heads, t, t),
        (x.layout.offsets[0], qkv_weight.layout.offsets[2] // d))
    o, lse = kernels.attention_forward(*views, True, scale, attention_drop)   # (B, H/tp, T, D)
    a = o.transpose(0, 2, 1, 3).reshape(rows * t, heads * d)            # (B T, C/tp)
    drop = _Dropout.of(resid_dropout_p, generator, residual, saved)
    out, mask = _projected(a, wp, proj_bias, residual, tp, drop)
    if not saved:
        return out
    x_info = _input_info(x, x_local, normed, tp)

    def input_part(g):
        gy, gbp = _projected_grads(g, drop, mask, a.dtype, proj_bias)
        ga = local_einsum("xz", "yz", "xy", gy, wp)
        grad = backend.xp.empty_like(qkv)
        do = ga.reshape(rows, t, heads, d).astype(o.dtype, copy=False).transpose(0, 2, 1, 3)
        kernels.attention_backward(*views, o, lse, do, True, scale, attention_drop,
                                   grads=unpacked(grad.reshape(rows, t, 3, heads, d)))
        return _input_grad(grad, wq, x_info), (gy, gbp, grad)

    def weight_part(state):
        gy, gbp, grad = state
        gwp, gbp = _weight_grads(a, gy, proj_weight, proj_bias, gbp)
        gwq, gbq = _weight_grads(_rows(x_local), grad, qkv_weight, qkv_bias)
        return (None if gwq is None else gwq.reshape(wq.shape),
                None if gbq is None else gbq.reshape(qkv_bias.local_shape), gwp, gbp)
    return _recorded(out, (x, residual, *params), input_part, weight_part,
                     "attention_residual", placements, normed,
                     None if drop is not None else (a.dtype, proj_bias))
