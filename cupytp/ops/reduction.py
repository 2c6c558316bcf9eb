"""Reductions (sum, mean, max over dimensions) and broadcast_to, their backward.

Rule, per mesh dimension: reducing a sharded dimension gives Partial (sum for sum and mean, max
for max) — the cross-rank reduction waits until something needs it; a Shard on a kept dimension
moves with the dimensions that remain; a Partial(sum) input stays Partial under sum and mean and
is reduced first under max.
"""
import math

from cupytp.launchers import compute_dtype, has_kernel, is_device_array
from cupytp.launchers.column_sum import column_sum
from cupytp.ops.conversion import (
    Partial, Replicated, Shard, backend, convert, engine, fail, make)


def _dims(x, dim):
    if dim is None:
        return tuple(range(x.ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not -x.ndim <= d < x.ndim:
            raise ValueError(f"reduction dim {d} is out of range for shape {x.shape}")
    return tuple(sorted({d % x.ndim for d in dims}))


def _reduced_layout(x, dims, keepdim, partial_op):
    shape, kept = [], {}
    for d, n in enumerate(x.shape):
        if d not in dims:
            kept[d] = len(shape)
            shape.append(n)
        elif keepdim:
            kept[d] = len(shape)
            shape.append(1)
    placements = []
    for p in x.placements:
        if isinstance(p, Shard):
            placements.append(Partial(partial_op) if p.dim in dims else Shard(kept[p.dim]))
        else:
            placements.append(p)
    return tuple(shape), tuple(placements)


def sum(x, dim=None, keepdim=False):
    """Sum over `dim` (all by default)."""
    dims = _dims(x, dim)
    x = convert("sum", x, [p if p.is_shard() or p == Partial("sum") else Replicated()
                           for p in x.placements], [x])
    shape, placements = _reduced_layout(x, dims, keepdim, "sum")
    out = make(local_sum(x._local, dims, keepdim), x.mesh, shape, placements)
    return engine.record(out, (x,), lambda g: (_expand_grad(g, x, dims, keepdim),), "sum")


def local_sum(v, dims, keepdim):
    """xp.sum, except that a sum of a contiguous float array over leading dimensions (a bias
    gradient) runs as `column_sum`: on a GPU its kernel, many times faster than CuPy's strided
    reduction, on the CPU its NumPy twin; both add 16-bit values in float32 and round once.
    Other sums of 16-bit arrays on the CPU add in float32 too (NumPy's own sum of bfloat16
    rounds every partial sum: a bias gradient over 2048 rows came out 5-20% off)."""
    lead = len(dims)
    if 0 < lead < v.ndim and dims == tuple(range(lead)) and has_kernel(v.dtype) and \
            backend.c_contiguous(v) and v.size:
        rest = v.shape[lead:]
        out = column_sum(v.reshape(-1, math.prod(rest)))
        return out.reshape(((1,) * lead if keepdim else ()) + rest)
    if not is_device_array(v) and v.dtype.itemsize == 2 and has_kernel(v.dtype):
        return backend.xp.sum(v, axis=dims, keepdims=keepdim,
                              dtype=compute_dtype(v.dtype)).astype(v.dtype)
    return backend.xp.sum(v, axis=dims, keepdims=keepdim)


def leading_sum_placements(placements, ndim):
    """Placements of a sum over all but the last of `ndim` dimensions (a bias gradient): a Shard
    of a summed dimension becomes Partial, one of the last dimension becomes Shard(0)."""
    return tuple(Shard(0) if p == Shard(ndim - 1) else
                 Partial() if isinstance(p, Shard) or p.is_partial() else p for p in placements)


def mean(x, dim=None, keepdim=False):
    """Mean over `dim` (all by default): the local sum over the global count."""
    dims = _dims(x, dim)
    count = 1
    for d in dims:
        count *= x.shape[d]
    return sum(x, dims, keepdim) * (1.0 / count)


def max(x, dim=None, keepdim=False):
    """Maximum over `dim`; over a sharded dim the result is Partial(max). Ties share the
    gradient evenly."""
    dims = _dims(x, dim)
    x = convert("max", x, [p if p.is_shard() else Replicated() for p in x.placements], [x])
    shape, placements = _reduced_layout(x, dims, keepdim, "max")
    local = backend.xp.max(x._local, axis=dims, keepdims=keepdim) if x._local.size else \
        backend.xp.full(make_shape(x._local.shape, dims, keepdim), -backend.xp.inf,
                        dtype=x.dtype)
    out = make(local, x.mesh, shape, placements)

    def backward(g):
        if any(p.is_partial() for p in placements):
            fail("max backward", [x], "the maximum over a sharded dimension has no gradient "
                 "here", "Redistribute x to Replicated along that dimension, or detach().")
        kept = local if keepdim else backend.xp.expand_dims(local, dims)
        hits = (x._local == kept).astype(x.dtype)
        share = hits / hits.sum(axis=dims, keepdims=True)
        expanded = _expand_grad(g, x, dims, keepdim)
        return (expanded * make(share, x.mesh, x.shape, x.placements),)
    return engine.record(out, (x,), backward, "max")


def make_shape(shape, dims, keepdim):
    return tuple(1 if d in dims else n for d, n in enumerate(shape) if keepdim or d not in dims)


def _expand_grad(g, x, dims, keepdim):
    """The gradient of a reduction over `dims`, broadcast back to x's shape and layout."""
    if not keepdim:
        g = g.reshape(tuple(1 if d in dims else n for d, n in enumerate(x.shape)))
    wanted = [p if isinstance(p, Shard) else gp for p, gp in zip(x.placements, g.placements)]
    return broadcast_to(g, x.shape, wanted)


def broadcast_to(x, shape, placements=None):
    """`x` broadcast to `shape`. With `placements`, an expanded dimension may come out sharded:
    each rank expands straight to its own part, so nothing full-size is built."""
    shape = tuple(shape)
    lead = len(shape) - x.ndim
    if lead < 0 or any(n != shape[lead + d] and n != 1 for d, n in enumerate(x.shape)):
        raise ValueError(f"cannot broadcast {x.shape} to {shape}")
    wanted = tuple(placements) if placements is not None else tuple(
        Shard(p.dim + lead) if isinstance(p, Shard) else p for p in x.placements)
    source = []
    for p, w in zip(x.placements, wanted):
        if isinstance(p, Shard) and w != Shard(p.dim + lead):
            fail("broadcast_to", [x], f"{w} was asked for an input sharded as {p}",
                 f"Ask for Shard({p.dim + lead}).")
        if isinstance(w, Shard):
            own = w.dim - lead
            expanded = own < 0 or x.shape[own] != shape[w.dim]
            source.append(Replicated() if expanded else Shard(own))
        elif w.is_partial() and not p.is_partial():
            fail("broadcast_to", [x], f"{w} was asked for a {p} input", "Ask for Replicated.")
        else:
            source.append(w)
    x = convert("broadcast_to", x, source, [x])
    out = make(None, x.mesh, shape, wanted)
    out._local = backend.xp.broadcast_to(x._local.reshape((1,) * lead + x._local.shape),
                                         out.layout.local_shape)
    return engine.record(out, (x,), lambda g: (g.sum_to_shape(x.shape),), "broadcast_to")


def sum_to_shape(x, shape):
    """Sum `x` over the dimensions that broadcasting added or expanded to reach x.shape."""
    shape = tuple(shape)
    lead = x.ndim - len(shape)
    expanded = tuple(lead + d for d, n in enumerate(shape) if n == 1 and x.shape[lead + d] != 1)
    if not lead and not expanded:
        return x
    out = sum(x, tuple(range(lead)) + expanded, keepdim=bool(expanded))   # leading dims alone:
    return out.reshape(shape) if out.shape != shape else out              # the shape, no reshape
