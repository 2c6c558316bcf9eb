"""Shape ops: reshape, transpose/permute, basic indexing, concat/split/stack.

Rules: a Shard follows its dimension through transposes; through a reshape it moves to the
dimension its data lands in, when every rank's part stays one block of that dimension with
array_split sizes (else: error, redistribute first); indexing and concatenation act on
dimensions that no mesh dimension shards. Partial passes through (all of these are linear).
"""
import math

import numpy

from cupytp.ops.base import (
    Partial, Replicated, Shard, backend, convert, engine, fail, linear_grad, make, same_mesh)


# ---- reshape ------------------------------------------------------------------------------------
def _groups(source, target):
    """Runs of source and target dimensions whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(source) and j < len(target):
        a, b = [i], [j]
        pa, pb = source[i], target[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(source):
                a.append(i)
                pa *= source[i]
                i += 1
            elif j < len(target):
                b.append(j)
                pb *= target[j]
                j += 1
            else:
                break
        groups.append((a, b))
    if groups:
        groups[-1][0].extend(range(i, len(source)))
        groups[-1][1].extend(range(j, len(target)))
    return groups


def _landing(x, dim, shape, groups):
    """The output dimension that sharded input dimension `dim` lands in, or a ShardingError."""
    for a, b in groups:
        if dim in a:
            outer = [d for d in a if d < dim and x.shape[d] != 1]
            landing = [e for e in b if shape[e] != 1]
            if not outer and landing:
                return landing[0], math.prod(x.shape[d] for d in a if d > dim), \
                    math.prod(shape[k] for k in b if k > landing[0])
    fail("reshape", [x], f"sharded dimension {dim} is not the outermost of the dimensions it "
         f"merges into in {shape}", "Redistribute that dimension to Replicated first.")


def _reshape_placements(x, shape):
    """x's placements carried into `shape`: each shard must stay one block per rank."""
    from cupytp.tensor.layout import Layout
    groups = _groups(x.shape, shape)
    landing = {d: _landing(x, d, shape, groups) for d in x.layout.sharded_dims()}
    placements = tuple(Shard(landing[p.dim][0]) if isinstance(p, Shard) else p
                       for p in x.placements)
    out = Layout(x.mesh, shape, placements)
    for coordinate in numpy.ndindex(*x.mesh.shape):
        (start_in, size_in), (start_out, size_out) = (
            x.layout.local_block(coordinate), out.local_block(coordinate))
        for d, (e, inner_in, inner_out) in landing.items():
            if (start_in[d] * inner_in, size_in[d] * inner_in) != \
                    (start_out[e] * inner_out, size_out[e] * inner_out):
                fail("reshape", [x], f"Shard({d}) cannot be carried into shape {shape} with "
                     "array_split sizes", "Redistribute that dimension to Replicated first.")
    return placements


def reshape(x, shape):
    """`x` with global shape `shape` (one entry may be -1)."""
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: only one -1 allowed, got {tuple(shape)}")
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = x.size // known if known else 0
    shape = tuple(int(n) for n in shape)
    if math.prod(shape) != x.size:
        raise ValueError(f"reshape: cannot view {x.shape} ({x.size} elements) as {shape}")
    if shape == x.shape:
        return x
    out = make(None, x.mesh, shape, _reshape_placements(x, shape))
    out._local = x._local.reshape(out.layout.local_shape)
    source = x.shape
    return engine.record(out, (x,), lambda g: (reshape(g, source),), "reshape")


# ---- transpose ----------------------------------------------------------------------------------
def permute(x, dims):
    """Dimensions of `x` reordered: output dim i is input dim dims[i]."""
    dims = tuple(d % x.ndim for d in dims)
    if sorted(dims) != list(range(x.ndim)):
        raise ValueError(f"permute: {dims} is not a permutation of {x.ndim} dimensions")
    placements = tuple(Shard(dims.index(p.dim)) if isinstance(p, Shard) else p
                       for p in x.placements)
    out = make(backend.xp.transpose(x._local, dims), x.mesh,
               tuple(x.shape[d] for d in dims), placements)
    inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))
    return engine.record(out, (x,), lambda g: (permute(g, inverse),), "permute")


def transpose(x, dim0, dim1):
    dims = list(range(x.ndim))
    dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
    return permute(x, dims)


# ---- indexing -----------------------------------------------------------------------------------
def _normalize_index(index, ndim):
    index = index if isinstance(index, tuple) else (index,)
    for item in index:
        if not (item is None or item is Ellipsis or isinstance(item, (int, numpy.integer, slice))):
            raise TypeError(f"DTensor indexing takes ints, slices, None and ...; got "
                            f"{type(item).__name__} (gather with ops.take_along_last or "
                            "ops.embedding)")
    if index.count(Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    used = sum(item is not None and item is not Ellipsis for item in index)
    if used > ndim:
        raise IndexError(f"too many indices for a tensor of {ndim} dimensions")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        return index[:at] + (slice(None),) * (ndim - used) + index[at + 1:]
    return index + (slice(None),) * (ndim - used)


def getitem(x, index):
    """Basic indexing (ints, slices, None, ...) on dimensions no mesh dimension shards."""
    index = _normalize_index(index, x.ndim)
    out_dim_of, source_dim, out_dim = {}, 0, 0
    for item in index:
        if item is None:
            out_dim += 1
            continue
        full = isinstance(item, slice) and item == slice(None)
        if not full and x.layout.sharded_dims() & {source_dim}:
            fail("getitem", [x], f"dimension {source_dim} is sharded and the index {item!r} "
                 "selects part of it", "Redistribute that dimension to Replicated first.")
        if not isinstance(item, (int, numpy.integer)):
            out_dim_of[source_dim] = out_dim
            out_dim += 1
        source_dim += 1
    shape = numpy.broadcast_to(numpy.empty((), numpy.int8), x.shape)[index].shape
    placements = tuple(Shard(out_dim_of[p.dim]) if isinstance(p, Shard) else p
                       for p in x.placements)
    out = make(x._local[index], x.mesh, shape, placements)

    def backward(g):
        g = linear_grad(g, placements)
        placements_in = tuple(p if isinstance(p, Shard) else gp
                              for p, gp in zip(x.placements, g.placements))
        local = backend.xp.zeros(x.local_shape, dtype=g.dtype)
        local[index] = g._local
        return (make(local, x.mesh, x.shape, placements_in),)
    return engine.record(out, (x,), backward, "getitem")


# ---- concat / split / stack ---------------------------------------------------------------------
def concat(tensors, dim=0):
    """Join `tensors` along `dim`, which no mesh dimension may shard."""
    tensors = list(tensors)
    same_mesh("concat", tensors)
    first = tensors[0]
    dim = dim % first.ndim
    targets = []
    for mesh_dim in range(first.mesh.ndim):
        placements = [t.placements[mesh_dim] for t in tensors]
        shards = {p.dim for p in placements if isinstance(p, Shard)}
        if dim in shards or len(shards) > 1:
            fail("concat", tensors, f"dimension {dim} or several dimensions are sharded",
                 "Redistribute the inputs to one Shard of another dimension, or Replicated.")
        if shards:
            targets.append(Shard(shards.pop()))
        elif all(p == Partial("sum") for p in placements):
            targets.append(Partial("sum"))
        else:
            targets.append(Replicated())
    tensors = [convert("concat", t, targets, tensors) for t in tensors]
    local = backend.xp.concatenate([t._local for t in tensors], axis=dim)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    out = make(local, first.mesh, tuple(shape), tuple(targets))
    bounds = numpy.cumsum([0] + [t.shape[dim] for t in tensors])

    def backward(g):
        return tuple(getitem(g, (slice(None),) * dim + (slice(int(lo), int(hi)),))
                     for lo, hi in zip(bounds[:-1], bounds[1:]))
    return engine.record(out, tuple(tensors), backward, "concat")


def split(x, sizes, dim=0):
    """Pieces of `x` along `dim`: `sizes` is a list of extents or a number of equal pieces."""
    dim = dim % x.ndim
    if isinstance(sizes, int):
        if x.shape[dim] % sizes:
            raise ValueError(f"split: {x.shape[dim]} does not divide into {sizes} equal pieces")
        sizes = [x.shape[dim] // sizes] * sizes
    if sum(sizes) != x.shape[dim]:
        raise ValueError(f"split: sizes {list(sizes)} do not add up to {x.shape[dim]}")
    bounds = numpy.cumsum([0] + list(sizes))
    return [getitem(x, (slice(None),) * dim + (slice(int(lo), int(hi)),))
            for lo, hi in zip(bounds[:-1], bounds[1:])]


def stack(tensors, dim=0):
    """Join `tensors` along a new dimension `dim`."""
    tensors = list(tensors)
    dim = dim % (tensors[0].ndim + 1)
    return concat([getitem(t, (slice(None),) * dim + (None,)) for t in tensors], dim)


def unsqueeze(x, dim):
    dim = dim % (x.ndim + 1)
    return getitem(x, (slice(None),) * dim + (None,))

