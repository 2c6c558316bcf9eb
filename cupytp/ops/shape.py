"""Shape ops: reshape, transpose/permute, basic indexing, concat/split/stack.

Rules: a Shard follows its dimension through transposes; through a reshape it moves to the
dimension its data lands in, when every rank's part stays one block of that dimension with
array_split sizes (else: error, redistribute first); indexing and concatenation act on
dimensions that no mesh dimension shards. Partial passes through (all of these are linear).
"""
import math

import numpy

from cupytp.ops.conversion import (
    Partial, Replicated, Shard, backend, cached, convert, engine, fail, linear_grad, make,
    same_mesh)


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


def _landings(x, dim, shape, groups):
    """Where sharded input dimension `dim` may land: (output dim, elements per step of `dim`,
    elements per step of it), the outermost dimension of size > 1 of its group first, then the
    group's dimensions of size 1 (for a `dim` of size 1). None when `dim` is not the outermost
    dimension of size > 1 of its group (a rank's part would not be one block)."""
    for a, b in groups:
        if dim in a:
            if any(d < dim and x.shape[d] != 1 for d in a):
                return []
            candidates = [e for e in b if shape[e] != 1][:1]
            if x.shape[dim] == 1:
                candidates += [e for e in b if shape[e] == 1]
            inner = math.prod(x.shape[d] for d in a if d > dim)
            return [(e, inner, math.prod(shape[k] for k in b if k > e)) for e in candidates]
    return []


def _keeps_blocks(x, shape, dim, mesh_dims, landing):
    """True when Shard(e) on `mesh_dims` gives every rank exactly its part of input `dim`."""
    from cupytp.tensor.layout import Layout
    e, inner_in, inner_out = landing
    out = Layout(x.mesh, shape, [Shard(e) if m in mesh_dims else Replicated()
                                 for m in range(x.mesh.ndim)])
    for coordinate in numpy.ndindex(*x.mesh.shape):
        (start_in, size_in), (start_out, size_out) = (x.layout.local_block(coordinate),
                                                      out.local_block(coordinate))
        if (start_in[dim] * inner_in, size_in[dim] * inner_in) != \
                (start_out[e] * inner_out, size_out[e] * inner_out):
            return False
    return True


def _reshape_placements(x, shape):
    """x's placements carried into `shape`: each shard must stay one block per rank. A Shard on
    mesh dimensions of one rank that has nowhere to go becomes Replicated (it splits nothing)."""
    groups = _groups(x.shape, shape)
    placements, taken = list(x.placements), set()
    splits = {d: [m for m, p in enumerate(x.placements) if p.is_shard(d)]
              for d in x.layout.sharded_dims()}
    trivial = {d for d, mesh_dims in splits.items() if all(x.mesh.shape[m] == 1
                                                           for m in mesh_dims)}
    for dim in sorted(splits, key=lambda d: (d in trivial, d)):    # real splits choose first
        mesh_dims = splits[dim]
        landing = next((c for c in _landings(x, dim, shape, groups)
                        if c[0] not in taken and _keeps_blocks(x, shape, dim, mesh_dims, c)), None)
        if landing is None and dim not in trivial:
            fail("reshape", [x], f"Shard({dim}) cannot be carried into shape {shape} as one "
                 "block per rank (a sharded dimension must be the outermost of those it merges "
                 "with, in numpy.array_split sizes)",
                 "Redistribute that dimension to Replicated first.")
        for m in mesh_dims:
            placements[m] = Replicated() if landing is None else Shard(landing[0])
        if landing is not None:
            taken.add(landing[0])
    return tuple(placements)


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
    placements = cached((_reshape_placements, x.shape, x.placements, x.mesh.shape, shape),
                        _reshape_placements, x, shape)
    out = make(None, x.mesh, shape, placements)
    out._local = x._local.reshape(out.layout.local_shape)
    source = x.shape
    return engine.record(out, (x,), lambda g: (reshape(g, source),), "reshape")


# ---- transpose ----------------------------------------------------------------------------------
def _permute_rule(shape, placements, dims):
    """(dims made non-negative, output shape, output placements, the inverse permutation)."""
    dims = tuple(d % len(shape) for d in dims)
    if sorted(dims) != list(range(len(shape))):
        raise ValueError(f"permute: {dims} is not a permutation of {len(shape)} dimensions")
    placements = tuple(Shard(dims.index(p.dim)) if isinstance(p, Shard) else p
                       for p in placements)
    inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))
    return dims, tuple(shape[d] for d in dims), placements, inverse


def permute(x, dims):
    """Dimensions of `x` reordered: output dim i is input dim dims[i]."""
    dims, shape, placements, inverse = cached((_permute_rule, x.shape, x.placements, tuple(dims)),
                                              _permute_rule, x.shape, x.placements, dims)
    out = make(backend.xp.transpose(x._local, dims), x.mesh, shape, placements)
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
    layout = x.layout           # not x: the tape would keep its values

    def backward(g):
        g = linear_grad(g, placements)
        placements_in = tuple(p if isinstance(p, Shard) else gp
                              for p, gp in zip(layout.placements, g.placements))
        local = backend.xp.zeros(layout.local_shape, dtype=g.dtype)
        local[index] = g._local
        return (make(local, layout.mesh, layout.shape, placements_in),)
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

