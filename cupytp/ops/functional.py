"""Neural-network ops: softmax, log_softmax, layer_norm, rms_norm, embedding, take_along_last,
cross_entropy, dropout, bias_dropout_add, scaled_dot_product_attention (grouped-query included).

softmax, log_softmax and the norms work along a dimension no mesh dimension shards. embedding
and take_along_last accept a table sharded along the looked-up dimension (vocab-parallel): each
rank answers the ids in its range, zeros elsewhere, and the output is Partial. cross_entropy on
vocab-sharded logits never gathers them: one max all-reduce, then one all-reduce of the packed
(sum of exponentials, target logit) pairs, around fused kernels that read the logits once each
way (`kernels/cross_entropy.cu`).
"""
import math

import numpy

from cupytp.launchers import compute_dtype, is_device_array
from cupytp.launchers.column_sum import column_sum
from cupytp.ops.conversion import (
    Layout, Partial, Replicated, Shard, backend, convert, engine, fail, is_tensor, linear_grad,
    make, reduce_all, same_mesh)
from cupytp.ops.elementwise import NONLINEAR, bias_residual_add, laid_out, mul
from cupytp.ops.amp import autocast_dtype
from cupytp.ops.linalg import autocast_operand, einsum
from cupytp.ops.reduction import leading_sum_placements, sum as reduce_sum
from cupytp.tensor.random import default_generator


def _unsharded(op, x, dim):
    dim = dim % x.ndim
    if dim in x.layout.sharded_dims():
        fail(op, [x], f"dimension {dim} is sharded",
             "Redistribute it to Replicated (for a loss over sharded vocabulary logits, "
             "cross_entropy handles the sharding).")
    return reduce_all(op, x), dim


def _compute_dtype(dtype):
    return backend.xp.float32 if dtype.itemsize < 4 else dtype


def softmax(x, dim=-1):
    x, dim = _unsharded("softmax", x, dim)
    xp = backend.xp
    v = x._local.astype(_compute_dtype(x.dtype), copy=False)
    e = xp.exp(v - v.max(axis=dim, keepdims=True))
    y = e / e.sum(axis=dim, keepdims=True)
    out = make(y.astype(x.dtype, copy=False), x.mesh, x.shape, x.placements)

    def backward(g):
        g = linear_grad(g, out.placements)
        gl = g._local.astype(y.dtype, copy=False)
        local = y * (gl - (gl * y).sum(axis=dim, keepdims=True))
        return (make(local.astype(x.dtype, copy=False), x.mesh, x.shape, g.placements),)
    return engine.record(out, (x,), backward, "softmax")


def log_softmax(x, dim=-1):
    x, dim = _unsharded("log_softmax", x, dim)
    xp = backend.xp
    v = x._local.astype(_compute_dtype(x.dtype), copy=False)
    shifted = v - v.max(axis=dim, keepdims=True)
    y = shifted - xp.log(xp.exp(shifted).sum(axis=dim, keepdims=True))
    out = make(y.astype(x.dtype, copy=False), x.mesh, x.shape, x.placements)

    def backward(g):
        g = linear_grad(g, out.placements)
        gl = g._local.astype(y.dtype, copy=False)
        local = gl - xp.exp(y) * gl.sum(axis=dim, keepdims=True)
        return (make(local.astype(x.dtype, copy=False), x.mesh, x.shape, g.placements),)
    return engine.record(out, (x,), backward, "log_softmax")


def causal_softmax(scores, scale=1.0):
    """softmax(scale · scores) over the last dimension, query t seeing keys s <= t + S - T of
    (..., T, S) scores; one fused kernel on GPU. The last two dimensions are unsharded."""
    from cupytp.launchers.softmax import causal_softmax as forward, causal_softmax_backward
    x, _ = _unsharded("causal_softmax", scores, -1)
    x, _ = _unsharded("causal_softmax", x, -2)
    xp = backend.xp
    y = forward(xp.ascontiguousarray(x._local), scale)
    out = make(y, x.mesh, x.shape, x.placements)

    def backward(g):
        g = linear_grad(g, out.placements)
        local = causal_softmax_backward(y, xp.ascontiguousarray(g._local), scale)
        return (make(local, x.mesh, x.shape, g.placements),)
    return engine.record(out, (x,), backward, "causal_softmax")


def layer_norm(x, weight, bias, eps=1e-5):
    """Normalize over the last dimension (unsharded), then scale by `weight` and shift by `bias`
    (both Replicated, shape (C,); either may be None). One fused kernel per direction on GPU;
    the weight and bias gradients are column sums over the leading (maybe sharded) dims. Inside
    `autocast`, a float32 input gives the autocast dtype (computed in float32, rounded once)."""
    from cupytp.launchers.layernorm import layer_norm_backward, layer_norm_forward

    def forward(x_local, params, out_dtype, keep):
        y, mean, rstd = layer_norm_forward(x_local, *params, eps, out_dtype, keep)
        return y, (x_local, mean, rstd)   # xhat is made again from x in backward

    def backward(g, saved, params, dx_dtype, add, sums):
        return layer_norm_backward(g, *saved, params[0], dx_dtype, add, param_grads=sums)
    return _normalization("layer_norm", x, (weight, bias), forward, backward)


def rms_norm(x, weight, eps=1e-6):
    """x / sqrt(mean(x²) + eps) over the last dimension (unsharded), scaled by `weight`
    (Replicated, shape (C,), or None): Llama's RMSNorm. One fused kernel per direction on GPU
    (`kernels/rmsnorm.cu`); the weight gradient is a column sum over the leading (maybe sharded)
    dims. Backward reads x again rather than a normalized copy (x, the residual stream, is kept
    anyway). Inside `autocast`, a float32 input gives the autocast dtype (computed in float32,
    rounded once)."""
    from cupytp.launchers.rmsnorm import rms_norm_backward, rms_norm_forward

    def forward(x_local, params, out_dtype, keep):
        y, rstd = rms_norm_forward(x_local, params[0], eps, out_dtype)
        return y, (x_local, rstd)

    def backward(g, saved, params, dx_dtype, add, sums):
        return rms_norm_backward(g, *saved, params[0], dx_dtype, add, weight_grad=sums)
    return _normalization("rms_norm", x, (weight,), forward, backward)


def _normalization(op, x, params, forward, backward):
    """The op of a normalization over x's last dimension (unsharded) with Replicated (C,)
    parameters `params` (None where absent): `forward(x_local, param_locals, out_dtype, keep)` →
    (y, saved), `keep` False when no backward will run (nothing need be written for it); `backward(g_local, saved, param_locals, dx_dtype, add, sums)` → dx, or with `sums`
    (dx, one column sum per parameter slot). `add` is x's gradient from elsewhere, summed in the
    kernel (the residual stream's, through the engine's sums_first)."""
    x, _ = _unsharded(op, x, -1)
    replicated = (Replicated(),) * x.mesh.ndim
    params = tuple(None if p is None else convert(op, p, replicated, [x, p]) for p in params)
    xp = backend.xp
    param_locals = tuple(None if p is None else p._local.astype(x.dtype, copy=False)
                         for p in params)
    wanted = autocast_dtype()
    out_dtype = wanted if wanted is not None and x.dtype == xp.float32 else x.dtype
    keep = engine.records((x,) + params)
    y, saved = forward(xp.ascontiguousarray(x._local), param_locals, out_dtype, keep)
    layout, x_dtype = x.layout, x.dtype     # closures keep layouts, not tensors
    out = make(y, layout.mesh, layout.shape, layout.placements)
    if not keep:
        return out
    sums = any(p is not None for p in params)

    def node_backward(g, given):
        # a Partial g (a column-parallel layer's input gradient) is reduced here, once, in its
        # own dtype: reducing dx and the parameter gradients instead costs more collectives
        g = linear_grad(g, layout.placements, strict=range(layout.mesh.ndim))
        gl = xp.ascontiguousarray(g._local).astype(out_dtype, copy=False)
        fused = given is not None and given.placements == g.placements and \
            given.dtype == x_dtype and backend.c_contiguous(given._local)
        dx = backward(gl, saved, param_locals, x_dtype, given._local if fused else None, sums)
        grads = [None] * len(params)
        if sums:            # column sums over the leading (maybe sharded) dims: Partial there
            dx, *columns = dx
            summed = leading_sum_placements(g.placements, g.ndim)
            grads = [None if p is None else make(c.astype(p.dtype, copy=False), p.mesh, p.shape,
                                                 summed) for p, c in zip(params, columns)]
        grad_x = make(dx, layout.mesh, layout.shape, g.placements)
        if given is not None and not fused:
            grad_x = grad_x + given
        return (grad_x, *grads)
    # sums_first: the residual stream's gradient from the block's addition joins dx in-kernel
    return engine.record(out, (x,) + params, node_backward, op, sums_first=True)


def _as_index(op, index, like):
    if is_tensor(index):
        return index
    from cupytp.tensor.factory import from_local
    local = backend.asarray(index)
    return from_local(local, like.mesh, (Replicated(),) * like.mesh.ndim, shape=local.shape)


def _vocab_window(table, placements, dim):
    """(offset, extent) of this rank's rows of `table` along `dim` (0, n when unsharded)."""
    if any(isinstance(p, Shard) and p.dim == dim for p in placements):
        return table.layout.offsets[dim], table.layout.local_shape[dim]
    return 0, table.shape[dim]


def embedding(ids, weight):
    """Rows of `weight` (V, C) at integer `ids` (any shape): output ids.shape + (C,).

    weight Shard(0) (vocab-parallel): ids Replicated, output Partial (ids outside this rank's rows
    give zeros); weight Shard(1): output sharded on its last dim; weight Replicated: the output
    follows the ids' sharding.
    """
    from cupytp.launchers.embedding import embedding_backward, embedding_forward
    ids = _as_index("embedding", ids, weight)
    targets_w, targets_ids, placements = [], [], []
    for dim in range(weight.mesh.ndim):
        pw, pi = weight.placements[dim], ids.placements[dim]
        if isinstance(pw, Shard) and isinstance(pi, Shard):
            fail("embedding", [ids, weight], f"mesh dimension {dim} shards both ids and weight",
                 "Replicate the ids along the mesh dimension that shards the table.")
        if isinstance(pw, Shard):
            targets_w.append(pw)
            targets_ids.append(Replicated())
            placements.append(Partial() if pw.dim == 0 else Shard(ids.ndim))
        else:
            targets_w.append(Replicated())
            targets_ids.append(pi)
            placements.append(pi)
    weight = convert("embedding", weight, targets_w, [ids, weight])
    ids = convert("embedding", ids, targets_ids, [ids, weight])
    xp = backend.xp
    offset, rows = _vocab_window(weight, weight.placements, 0)
    local_ids = xp.ascontiguousarray(ids._local, dtype=xp.int64)
    local = embedding_forward(local_ids, xp.ascontiguousarray(weight._local), offset)
    placements = tuple(placements)
    out = make(local, weight.mesh, ids.shape + (weight.shape[1],), placements)

    sharded = {dim for dim, p in enumerate(weight.placements) if isinstance(p, Shard)}

    def backward(g):
        g = linear_grad(g, placements, strict=sharded)
        grad_placements = tuple(pw if isinstance(pw, Shard) else
                                (Partial() if gp.is_partial() or isinstance(gp, Shard) else gp)
                                for pw, gp in zip(weight.placements, g.placements))
        into = weight.grad_to_sum_into(grad_placements, g.dtype) \
            if _compute_dtype(g.dtype) == g.dtype else None     # a tied table's other gradient
        grad = embedding_backward(local_ids, xp.ascontiguousarray(g._local), rows, offset, into)
        return (None, None if into is not None else
                make(grad, weight.mesh, weight.shape, grad_placements))
    return engine.record(out, (ids, weight), backward, "embedding")


def _along_last(op, x, index, linear):
    """`x` (..., V) and `index` (...), one entry per row, converted for an op along the last
    dimension; returns (x, index, row placements, vocab mesh dims). On a mesh dim that shards V,
    index is Replicated and each rank holds part of every row (the row placement there is
    Partial); a shard of a row dim is shared by x and index. A Partial(sum) x stays Partial when
    the op is `linear` in it, else it is reduced."""
    if index.shape != x.shape[:-1]:
        raise ValueError(f"{op}: index shape {index.shape} must be {x.shape[:-1]} (the rows of "
                         f"{x.shape})")
    last = x.ndim - 1
    targets_x, targets_i, placements, vocab_dims = [], [], [], set()
    for dim in range(x.mesh.ndim):
        px, pi = x.placements[dim], index.placements[dim]
        if isinstance(px, Shard) and px.dim == last:
            targets_x.append(px)
            targets_i.append(Replicated())
            placements.append(Partial())
            vocab_dims.add(dim)
        elif isinstance(px, Shard) or isinstance(pi, Shard):
            d = px.dim if isinstance(px, Shard) else pi.dim
            targets_x.append(Shard(d))
            targets_i.append(Shard(d))
            placements.append(Shard(d))
        elif linear and px.is_partial() and px.op == "sum":
            targets_x.append(px)
            targets_i.append(Replicated())
            placements.append(px)
        else:
            targets_x.append(Replicated())
            targets_i.append(Replicated())
            placements.append(Replicated())
    x = convert(op, x, targets_x, [x, index])
    index = convert(op, index, targets_i, [x, index])
    return x, index, tuple(placements), vocab_dims


def take_along_last(x, index):
    """out[...] = x[..., index[...]]: one entry of the last dimension per position. With x
    sharded on its last dimension, each rank answers the indices in its range (Partial)."""
    index = _as_index("take_along_last", index, x)
    x, index, placements, sharded = _along_last("take_along_last", x, index, linear=True)
    xp = backend.xp
    offset, extent = _vocab_window(x, x.placements, x.ndim - 1)
    local_index = index._local - offset
    valid = (local_index >= 0) & (local_index < extent)
    safe = xp.where(valid, local_index, 0)[..., None]
    local = xp.where(valid, xp.take_along_axis(x._local, safe, axis=-1)[..., 0], x.dtype.type(0))
    out = make(local, x.mesh, index.shape, placements)
    sharded |= {dim for dim, p in enumerate(x.placements) if isinstance(p, Shard)}

    def backward(g):
        g = linear_grad(g, out.placements, strict=sharded)
        grad = xp.zeros(x.local_shape, dtype=g.dtype)
        xp.put_along_axis(grad, safe, (g._local * valid.astype(g.dtype))[..., None], axis=-1)
        grad_placements = tuple(px if isinstance(px, Shard) else gp
                                for px, gp in zip(x.placements, g.placements))
        return (make(grad, x.mesh, x.shape, grad_placements), None)
    return engine.record(out, (x, index), backward, "take_along_last")


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean", vocab_size=None):
    """Cross-entropy of `logits` (..., V) against integer `targets` (...), computed in float32
    (float64 for float64 logits) without copying the logits; the loss has that dtype.

    Columns at or past the global index `vocab_size` (default V) do not exist: a padded
    vocabulary's columns never count. Vocab-sharded logits (Shard on the last dim) are never
    gathered: a max all-reduce of the per-row maxima, then a sum all-reduce of the packed
    (sum of exponentials, target logit) per row; the backward needs no communication. Targets
    equal to `ignore_index` count for nothing ("mean" divides by the number of the others; where
    the tokens are split over ranks, their loss sum and count are all-reduced together, once);
    any other target outside [0, vocab_size) makes the loss NaN (checked on the device: no
    sync). Where a backward will follow, the vocabulary is whole on each rank and a row fits a
    block's shared memory, the forward writes the logits' gradient in its pass, for the per-row
    gradient the last backward brought (`_learned_gradient`); the backward then rewrites only
    rows whose gradient differs.
    """
    from cupytp.launchers.cross_entropy import (
        cross_entropy_backward, cross_entropy_forward, cross_entropy_forward_grad,
        forward_grad_fits)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction {reduction!r} is not mean, sum or none")
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    if not 0 < vocab_size <= logits.shape[-1]:
        raise ValueError(f"cross_entropy: vocab_size {vocab_size} must be in [1, "
                         f"{logits.shape[-1]}] (the logits' last dimension)")
    targets = _as_index("cross_entropy", targets, logits)
    if targets.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: targets must be integers, got {targets.dtype}")
    logits, targets, placements, vocab_dims = _along_last("cross_entropy", logits, targets,
                                                          linear=False)
    xp = backend.xp
    offset, _ = _vocab_window(logits, logits.placements, logits.ndim - 1)
    x = xp.ascontiguousarray(logits._local)
    ids = xp.ascontiguousarray(targets._local, dtype=xp.int64)
    window = (offset, vocab_size, ignore_index)
    if engine.records((logits,)) and forward_grad_fits(x) and \
            not any(logits.mesh.shape[d] > 1 for d in vocab_dims):
        learned = _learned_gradient(x)      # the gradient written now: the last backward's
        local_max, stats, dx, expected = cross_entropy_forward_grad(x, ids, *window, learned)
        written = (expected, learned, dx)
    else:
        local_max, stats = cross_entropy_forward(x, ids, *window)    # (rows,), (rows, 2)
        written = ()
    max_placements = tuple(Partial("max") if p.is_partial() else p for p in placements)
    row_max = reduce_all("cross_entropy", make(local_max, logits.mesh, targets.shape,
                                               max_placements))
    stats[..., 0] *= xp.exp(local_max - row_max._local)           # sum of exp(x - global max)
    packed = reduce_all("cross_entropy", make(stats, logits.mesh, targets.shape + (2,),
                                              placements))
    kept = ids != ignore_index
    row_sum, picked = xp.ascontiguousarray(packed._local[..., 0]), packed._local[..., 1]
    m = row_max._local
    local = xp.where(kept, xp.log(row_sum) + m - picked, m.dtype.type(0))
    out = make(local, logits.mesh, targets.shape, packed.placements)

    def backward(g):
        g = linear_grad(g, out.placements, strict=vocab_dims)
        grad = cross_entropy_backward(x, m, row_sum, ids,
                                      xp.ascontiguousarray(g._local, dtype=m.dtype), *window,
                                      *written)
        grad_placements = tuple(px if isinstance(px, Shard) else gp
                                for px, gp in zip(logits.placements, g.placements))
        return (make(grad, logits.mesh, logits.shape, grad_placements), None)
    losses = engine.record(out, (logits, targets), backward, "cross_entropy")
    if reduction == "none":
        return losses
    total = reduce_sum(losses)
    if reduction == "sum":
        return total
    valid = make(kept.astype(m.dtype), targets.mesh, targets.shape, targets.placements)
    return _packed_mean(total, reduce_sum(valid))


_learned_gradients = {}     # (array module, rows' shape, compute dtype) -> 1-element array


def _learned_gradient(logits):
    """The per-row loss gradient the last backward of cross-entropy over logits of this shape
    brought (1 before any): the forward writes its gradient for it (`cross_entropy_forward_grad`).
    One lasting array per shape, read and written by the kernels (so also by CUDA graphs)."""
    from cupytp.launchers import lasting_buffer
    compute = compute_dtype(logits.dtype)
    key = (is_device_array(logits), logits.shape[:-1], compute)
    learned = _learned_gradients.get(key)
    if learned is None:
        if key[0]:
            learned = lasting_buffer(compute.itemsize).view(compute)
            learned[...] = 1
        else:
            learned = numpy.ones(1, compute)
        _learned_gradients[key] = learned
    return learned


def _packed_mean(total, count):
    """total / count for 0-d tensors laid out alike (count needs no gradient). Where they are
    Partial over a mesh dimension of more than one rank (tokens split over dp), one all-reduce
    of the packed pair reduces both, not one all-reduce each."""
    from cupytp.ops.shape import stack
    placements = total.placements
    if count.placements != placements or not any(
            p.is_partial() and n > 1 for p, n in zip(placements, total.mesh.shape)):
        return total / count
    both = stack([total, count]).redistribute(
        tuple(Replicated() if p.is_partial() else p for p in placements))
    return both[0] / both[1]


def _dropout_p(p, what="dropout probability"):
    if not 0 <= p < 1:
        raise ValueError(f"{what} must be in [0, 1), got {p}")


def dropout(x, p, training=True, generator=None, order=None):
    """Zero each element with probability `p`, scale the rest by 1/(1-p). The mask comes from
    the counter-based generator by global element index: the same on any mesh. Each decision
    compares 16 random bits with ceil(p·2¹⁶), so the probability dropped is p rounded up to a
    multiple of 2⁻¹⁶ (0.1 drops 0.100006; launchers/philox.py). One kernel each
    way on a GPU (`kernels/dropout.cu`): the forward keeps a 1-bit mask for the backward (when
    x requires a gradient). Linear: a Partial x stays Partial. `order`: for a tensor whose
    dimension 1 (the sequence) is a permutation (context parallelism's zigzag), the position of
    each of its global indices there (an integer array of x.shape[1]): the mask is then drawn
    by position, the one the sequence in its natural order gets."""
    from cupytp.launchers.dropout import dropout as forward, dropout_backward
    _dropout_p(p)
    if not training or p == 0:
        return x
    counters = (generator or default_generator).counters(x.shape, *x.layout.local_block())
    if order is not None:
        return _dropout_in_order(x, p, counters, order)
    layout = x.layout
    y, mask = forward(backend.xp.ascontiguousarray(x._local), p, counters,
                      keep_mask=engine.records((x,)))
    out = make(y, layout.mesh, layout.shape, layout.placements)

    def backward(g):
        g = linear_grad(g, layout.placements)
        local = dropout_backward(backend.xp.ascontiguousarray(g._local), mask, p)
        return (make(local, layout.mesh, layout.shape, g.placements),)
    return engine.record(out, (x,), backward, "dropout")


def _dropout_in_order(x, p, counters, order):
    """`dropout` of a tensor whose dimension-1 indices stand for the positions `order`: each run
    of consecutive positions draws the scale of its block (the dropout kernel over ones: one
    launch on a GPU), and x is scaled by it."""
    from cupytp.launchers.dropout import dropout as draw
    shape, (offsets, local_shape) = x.shape, (counters.offsets, counters.local_shape)
    if len(order) != shape[1]:
        raise ValueError(f"dropout: order has {len(order)} positions for a dimension 1 of "
                         f"{shape[1]}")
    rows = [int(r) for r in order[offsets[1]:offsets[1] + local_shape[1]]]
    starts = [i for i in range(len(rows)) if i == 0 or rows[i] != rows[i - 1] + 1]
    pieces = []
    for start, stop in zip(starts, starts[1:] + [len(rows)]):
        run = counters._replace(offsets=offsets[:1] + (rows[start],) + offsets[2:],
                                local_shape=local_shape[:1] + (stop - start,) + local_shape[2:])
        pieces.append(draw(backend.xp.ones(run.local_shape, x.dtype), p, run, keep_mask=False)[0])
    scale = backend.xp.concatenate(pieces, axis=1)
    layout = x.layout
    out = make(x._local * scale, layout.mesh, layout.shape, layout.placements)

    def backward(g):
        g = linear_grad(g, layout.placements)
        return (make(g._local * scale, layout.mesh, layout.shape, g.placements),)
    return engine.record(out, (x,), backward, "dropout")


def bias_dropout_add(y, bias, residual, p, training=True, generator=None):
    """residual + dropout(y + bias) (Megatron's bias-dropout-add): a projection's output y, its
    bias (C,) along y's last dimension (or None) and the residual stream (y's shape), in one
    pass on a GPU (`kernels/dropout.cu`, which keeps a 1-bit mask for the backward). The mask
    is `dropout`'s of y's global shape, the same on any mesh. Partial inputs (a row-parallel
    output) are reduced first; the output has the residual's dtype (autocast: a 16-bit y, an
    fp32 bias and residual stream). Without dropout in effect it is `bias_residual_add`."""
    from cupytp.launchers import dropout as kernels
    _dropout_p(p)
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != y.shape[-1]):
        raise ValueError(f"bias_dropout_add: bias must have shape ({y.shape[-1]},) (y's last "
                         f"dimension), got {bias.shape}")
    if y.shape != residual.shape:
        raise ValueError(f"bias_dropout_add: y {y.shape} and the residual {residual.shape} must "
                         "have one shape")
    if not training or p == 0:
        return residual + y if bias is None else bias_residual_add(y, bias, residual)
    if not kernels.applies(y.dtype, None if bias is None else bias.dtype, residual.dtype):
        return residual + dropout(y if bias is None else y + bias, p, generator=generator)
    operands = [residual, y] if bias is None else [residual, y, bias]
    operands, mesh, shape, placements = laid_out("bias_dropout_add", operands, NONLINEAR)
    residual, y, bias = operands + [None] * (3 - len(operands))
    layout = Layout.trusted(mesh, shape, placements)
    counters = (generator or default_generator).counters(shape, *layout.local_block())
    xp = backend.xp
    local = [None if t is None else xp.ascontiguousarray(t._local) for t in (y, bias, residual)]
    out_local, mask = kernels.dropout(local[0], p, counters, local[1], local[2],
                                      keep_mask=engine.records((y, bias)))
    out = make(out_local, mesh, shape, placements)
    y_dtype = y.dtype

    def backward(g):
        g = linear_grad(g, placements)
        gy = kernels.dropout_backward(xp.ascontiguousarray(g._local), mask, p, y_dtype)
        grads = (g, make(gy, mesh, shape, g.placements))
        if bias is None:
            return grads
        return grads + (make(column_sum(gy, dtype=bias.dtype), bias.mesh, bias.shape,
                             leading_sum_placements(g.placements, len(shape)))
                        if bias.requires_grad else None,)
    return engine.record(out, operands, backward, "bias_dropout_add")


def scaled_dot_product_attention(q, k, v, causal=True, dropout_p=0.0, generator=None):
    """softmax(q kᵀ / sqrt(D)) v over (B, H, T, D) queries and (B, Hk, S, D) keys and values,
    query t seeing keys s <= t + S - T when causal. Hk may be a divisor of H (grouped-query
    attention: query head h attends with key/value head h // (H / Hk)). Batch and heads may be
    sharded (Shard(0), Shard(1)), with no communication: where q's heads are sharded, k and v
    shard theirs alike when both head counts divide by that mesh dim's size, else they are
    Replicated along it and each rank reads the key/value heads its query heads need (their
    gradient is then Partial there: each rank's share). Dropout with probability `dropout_p` on
    the probabilities, by their global (b, h, t, s) index: the same mask on any mesh and on both
    paths.

    Inside `autocast` q, k and v are cast to its dtype first, as contractions are. bf16/fp16
    with head dim 64 or 128: flash attention, one node whose kernels never store the (T, S)
    scores (`kernels/flash_attention.cu`, or cuDNN's where `launchers/cudnn_attention.py` says;
    the NumPy twin on CPU), reading each key/value head in place for all its query heads.
    Otherwise, or with CUPYTP_ATTENTION=matmul, the scores are materialized: einsum (k and v
    first repeated per query head), fused causal softmax, `dropout`, einsum."""
    from cupytp.launchers import cudnn_attention
    from cupytp.launchers.flash_attention import supported
    _dropout_p(dropout_p, "attention dropout probability")
    q, k, v = (autocast_operand(x) for x in (q, k, v))
    q, k, v, groups = _grouped_inputs(q, k, v)
    if supported(q._local, k._local, v._local) and cudnn_attention.choice() != "matmul":
        return _flash_attention(q, k, v, groups, causal, dropout_p, generator)
    if k.shape[1] != q.shape[1]:
        k, v = (_repeated_heads(x, q.layout, groups) for x in (k, v))
    scores = einsum("bhtd,bhsd->bhts", q, k)                    # (B, H/tp, T, S)
    scale = 1.0 / math.sqrt(q.shape[-1])
    probs = causal_softmax(scores, scale) if causal else softmax(mul(scores, scale), -1)
    probs = dropout(probs, dropout_p, generator=generator)
    return einsum("bhts,bhsd->bhtd", probs, v)


def _grouped_inputs(q, k, v):
    """(q, k, v converted to the placements attention takes, their HeadGroups): per mesh
    dimension the Shard(0) or Shard(1) of any input (Shard(1): q's heads; k's and v's too where
    both head counts divide by the dim's size, else Replicated), else Replicated."""
    from cupytp.launchers.flash_attention import HeadGroups
    inputs = [q, k, v]
    same_mesh("scaled_dot_product_attention", inputs)
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or kv_heads == 0 or heads % kv_heads \
            or q.shape[::3] != k.shape[::3]:
        raise ValueError(f"attention takes q (B, H, T, D) and k, v (B, Hk, S, D) with Hk "
                         f"dividing H, got q {q.shape}, k {k.shape}, v {v.shape}")
    q_targets, kv_targets = [], []
    for dim, size in enumerate(q.mesh.shape):
        shards = {x.placements[dim].dim for x in inputs if isinstance(x.placements[dim], Shard)}
        if len(shards) > 1 or shards - {0, 1}:
            fail("scaled_dot_product_attention", inputs,
                 f"mesh dimension {dim} shards dimensions {sorted(shards)}",
                 "Shard q, k and v alike on batch (0) or heads (1) only; redistribute the "
                 "sequence and head-size dimensions to Replicated.")
        placement = Shard(shards.pop()) if shards else Replicated()
        q_targets.append(placement)
        split_kv = placement != Shard(1) or heads == kv_heads or \
            (heads % size == 0 and kv_heads % size == 0)
        kv_targets.append(placement if split_kv else Replicated())
    q = convert("scaled_dot_product_attention", q, q_targets, inputs)
    k, v = (convert("scaled_dot_product_attention", x, kv_targets, inputs) for x in (k, v))
    group = heads // kv_heads
    return q, k, v, HeadGroups(group, q.layout.offsets[1] - k.layout.offsets[1] * group)


def _kv_grad_placements(q_placements, kv_placements, grad_placements):
    """The placements of k's and v's gradients, given those of the output's gradient: Partial
    where q's heads are sharded and k's are not (each rank's share), else the output gradient's
    (k and v laid out like q)."""
    return tuple(Partial() if pq == Shard(1) and pk == Replicated() else pg
                 for pq, pk, pg in zip(q_placements, kv_placements, grad_placements))


def _repeated_heads(kv, q_layout, groups):
    """kv (B, Hk, S, D) with the key/value head of each of q's heads, laid out like q's heads
    (B, H, S, D) (a copy, for the matmul path); the backward sums each group's gradients into
    its key/value head. The head maps are made on the device (capturable in a CUDA graph)."""
    xp = backend.xp
    index = (xp.arange(q_layout.local_shape[1]) + groups.offset) // groups.group
    placements = tuple(pq if pq == Shard(1) else pk
                       for pq, pk in zip(q_layout.placements, kv.placements))
    out = make(kv._local[:, index], kv.mesh, kv.shape[:1] + q_layout.shape[1:2] + kv.shape[2:],
               placements)
    kv_layout = kv.layout

    heads, kv_heads = q_layout.local_shape[1], kv_layout.local_shape[1]

    def backward(g):
        g = linear_grad(g, out.placements)
        local = g._local.astype(compute_dtype(g.dtype), copy=False)     # sums in fp32 or wider
        grad = xp.zeros(local.shape[:1] + (kv_heads,) + local.shape[2:], local.dtype)
        for j in range(kv_heads):       # query heads of key/value head j: a run of this rank's
            lo = max(j * groups.group - groups.offset, 0)       # (sums, not a product: no
            hi = min((j + 1) * groups.group - groups.offset, heads)     # cuBLAS call, which
            if hi > lo:                                         # a CUDA graph cannot capture)
                grad[:, j] = local[:, lo:hi].sum(axis=1)
        return (make(grad.astype(g.dtype, copy=False), kv_layout.mesh, kv_layout.shape,
                     _kv_grad_placements(q_layout.placements, kv_layout.placements,
                                         g.placements)),)
    return engine.record(out, (kv,), backward, "repeat_kv_heads")


def _flash_attention(q, k, v, groups, causal, dropout_p, generator):
    """One node: flash forward (o and the row log-sum-exp kept), flash backward; cuDNN's fused
    attention instead where it applies (`launchers/cudnn_attention.py`, CUPYTP_ATTENTION)."""
    kernels, scale, drop = attention_setup(q._local, k._local, dropout_p, generator,
                                            q.shape[:3] + k.shape[2:3], q.layout.offsets[:2],
                                            groups)
    o, lse = kernels.attention_forward(q._local, k._local, v._local, causal, scale, drop,
                                       groups=groups)
    out = make(o, q.mesh, q.shape, q.placements)                # (B, H/tp, T, D)
    q_placements, kv_layout = q.placements, k.layout

    def backward(g):
        g = linear_grad(g, out.placements)
        grads = kernels.attention_backward(q._local, k._local, v._local, o, lse,
                                           g._local.astype(o.dtype, copy=False), causal, scale,
                                           drop, groups=groups)
        kv_placements = _kv_grad_placements(q_placements, kv_layout.placements, g.placements)
        return (make(grads[0], q.mesh, q.shape, g.placements),
                *[make(local, kv_layout.mesh, kv_layout.shape, kv_placements)
                  for local in grads[1:]])
    return engine.record(out, (q, k, v), backward, "scaled_dot_product_attention")


def attention_setup(q, k, dropout_p, generator, shape, offsets, groups=None):
    """(kernels, scale, dropout) for flash attention on local (B, H, T, D) queries and (B, Hk,
    S, D) keys of a global (B, H, T, S) problem at (batch, head) `offsets`, key/value heads read
    by `groups` (HeadGroups, None: as many as q's): cuDNN's kernels where they apply, else the
    RawKernel's; the dropout draws counters of the global problem, and the forward keeps its
    bits for the backward where `flash_attention.kept_bits` gives a store."""
    from cupytp.launchers import cudnn_attention, flash_attention
    drop = None
    if dropout_p > 0:       # inside a micro-batch, add skips the batch's rows before it
        seed, base, add = (generator or default_generator).philox_args(shape)
        drop = flash_attention.AttentionDropout(dropout_p, seed, base, add, shape[1], *offsets,
                                                mask=flash_attention.kept_bits(q, k))
    kernels = cudnn_attention if cudnn_attention.applies(q, k, dropout_p, groups) else \
        flash_attention
    return kernels, 1.0 / math.sqrt(q.shape[-1]), drop


def packed_attention(qkv, causal=True, dropout_p=0.0, generator=None):
    """Attention over packed queries, keys and values `qkv` (B, T, 3, H, D) (a fused q|k|v
    projection's output): (B, T, H, D), the `scaled_dot_product_attention` of qkv[:, :, i]
    transposed to (B, H, T, D). Batch Shard(0) and heads Shard(3) need no communication. On the
    flash path the kernels read the three parts in place and the backward writes their gradients
    straight into one packed gradient (no scatter of three)."""
    from cupytp.launchers import cudnn_attention
    from cupytp.launchers.flash_attention import supported
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"packed_attention takes q|k|v packed as (B, T, 3, H, D), got shape "
                         f"{qkv.shape}")
    _dropout_p(dropout_p, "attention dropout probability")
    qkv = autocast_operand(qkv)
    if not supported(*unpacked(qkv._local)) or cudnn_attention.choice() == "matmul":
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        y = scaled_dot_product_attention(q, k, v, causal, dropout_p, generator)
        return y.transpose(1, 2)
    placements = tuple(p if p in (Shard(0), Shard(3)) else Replicated() for p in qkv.placements)
    qkv = convert("packed_attention", qkv, placements, [qkv])
    b, t, _, h, d = qkv.shape
    views = unpacked(qkv._local)
    kernels, scale, drop = attention_setup(views[0], views[1], dropout_p, generator,
                                            (b, h, t, t), qkv.layout.offsets[::3][:2])
    o, lse = kernels.attention_forward(*views, causal, scale, drop)   # (B, H, T, D) view
    out = make(o.transpose(0, 2, 1, 3), qkv.mesh, (b, t, h, d),
               tuple(Shard(2) if p == Shard(3) else p for p in placements))

    def backward(g):
        g = linear_grad(g, out.placements)
        grad = backend.xp.empty_like(qkv._local)
        do = g._local.astype(o.dtype, copy=False).transpose(0, 2, 1, 3)
        kernels.attention_backward(*views, o, lse, do, causal, scale, drop,
                                   grads=unpacked(grad))
        return (make(grad, qkv.mesh, qkv.shape, placements),)
    return engine.record(out, (qkv,), backward, "packed_attention")


def unpacked(qkv):
    """The parts of a local (B, T, P, H, D) array (q, k and v of a fused projection: P = 3) as
    (B, H, T, D) strided arrays: views, or on a GPU arrays made directly over its memory (slices
    and transposes cost several times more host time there)."""
    parts = qkv.shape[2]
    if not (is_device_array(qkv) and backend.c_contiguous(qkv)):
        return tuple(qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(parts))
    b, t, _, h, d = qkv.shape
    size = qkv.itemsize
    strides = (parts * t * h * d * size, d * size, parts * h * d * size, size)
    array = backend.xp.ndarray
    return tuple(array((b, h, t, d), qkv.dtype, qkv.data + i * h * d * size, strides)
                 for i in range(parts))
