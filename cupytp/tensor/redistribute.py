"""redistribute: move a DTensor from one set of placements to another.

One table names the collective for each change of placement along one mesh dimension:

| from → to   | collective                               | its backward (conjugate)  |
|-------------|------------------------------------------|---------------------------|
| S(d) → R    | all-gather along d                       | R → S(d): local slice     |
| R → S(d)    | local slice                              | all-gather along d        |
| P → R       | all-reduce                               | identity (R → R)          |
| P → S(d)    | reduce-scatter along d                   | all-gather along d        |
| S(d) → S(e) | all-to-all                               | all-to-all                |
| R → P       | rank 0 keeps the value, the others zeros | identity                  |

`redistribute(x, placements)` (also `DTensor.redistribute`) is differentiable: it records its
own node, whose backward is the redistribution of the gradient back to the input's placements
(a Partial input's gradient is Replicated), which yields the conjugate above. Changes on several
mesh dimensions run innermost-first to Replicated, then outermost-first to the target, so nested
sharding of one tensor dimension stays right. A change along a mesh dimension of one rank moves
no data: only the labels change.
"""
import functools

from cupytp import backend
from cupytp.autograd import engine
from cupytp.distributed.process_group import Pending, Work, split_sizes
from cupytp.tensor.layout import Layout
from cupytp.tensor.placement import Partial, Replicated, Shard, describe


class RedistributeError(ValueError):
    """A requested redistribution that has no meaning (e.g. a mesh mismatch)."""


@functools.lru_cache(maxsize=1024)
def grad_placements(placements):
    """The placements of a gradient for a value with `placements` (a tuple): Partial becomes
    Replicated."""
    return tuple(Replicated() if p.is_partial() else p for p in placements)


def _slice_local(local, dim, parts, index):
    sizes = split_sizes(local.shape[dim], parts)
    start = sum(sizes[:index])
    selector = [slice(None)] * local.ndim
    selector[dim] = slice(start, start + sizes[index])
    return local[tuple(selector)]


def _involves(placement, dims):
    return isinstance(placement, Shard) and placement.dim in dims


def _plan(current, target):
    """Mesh dims that must change, with their nested neighbours (see module docstring)."""
    dirty = {i for i, (c, t) in enumerate(zip(current, target)) if c != t}
    for i, c in enumerate(current):
        if isinstance(c, Shard) and any(k < i and (_involves(current[k], {c.dim}) or
                                                   _involves(target[k], {c.dim}))
                                        for k in dirty):
            dirty.add(i)
    return sorted(dirty)


def _direct_ok(current, target, mesh_dim, dims):
    """A one-collective change at `mesh_dim` is safe when no other mesh dim shards `dims`, or
    only outer ones (before it) that keep their placement: this mesh dim then splits, or joins,
    the block those give this rank (a sequence sharded over cp, then reduce-scattered over tp
    by sequence parallelism)."""
    n = len(current)
    return not any(_involves(p, dims) for k, p in enumerate(current + target)
                   if k % n != mesh_dim and not (k % n < mesh_dim and
                                                 current[k % n] == target[k % n]))


def redistribute(x, placements, async_op=False):
    """`x` (a DTensor) with `placements`, one per mesh dimension; its backward redistributes
    the gradient back to x's placements (Partial made Replicated) along the mesh dimensions
    this changed; along the others a Partial gradient of a Replicated x stays Partial (lazy
    reduction: a batch's sum over data-parallel ranks is reduced where something needs it, by
    the data-parallel engine for a parameter). With `async_op=True`, a Work whose wait() gives
    the DTensor."""
    source = x.layout
    local, layout = redistribute_local(x._local, source, placements, async_op)
    back = grad_placements(source.placements)
    kept = tuple(before == after and not before.is_shard()
                 for before, after in zip(source.placements, placements))

    def backward(g):
        if any(p.is_partial() and p.op != "sum" for p in source.placements):
            raise RuntimeError("no gradient through the reduction of a Partial(max) value; "
                               "detach() it (as cross_entropy does with its max)")
        target = tuple(p if keep and p == Partial() else b
                       for p, b, keep in zip(g.placements, back, kept))
        return (redistribute(g, target),)

    def finish(local):
        return engine.record(type(x)._make(local, layout), (x,), backward, "redistribute")

    if async_op:
        return Work(Pending(local.wait, local.is_completed), lambda: finish(local.wait()))
    return finish(local)


def redistribute_local(local, layout, placements, async_op=False, in_place=False):
    """(new local array or Work, new Layout): the data movement of a redistribution, no autograd.

    With `async_op`, the last collective returns a Work whose wait() gives the local array.
    `in_place`: a redistribution made only of all-reduces (Partial → Replicated) writes them
    into `local` (C-contiguous), which is then the result (a flat gradient buffer).
    """
    mesh = layout.mesh
    new_layout = layout.with_placements(placements)
    placements_now = list(layout.placements)
    steps = _steps(layout.placements, new_layout.placements, mesh.shape)
    if in_place and not all(c.is_partial() and t.is_replicated() for _, c, t in steps):
        raise RedistributeError(f"in_place: {describe(layout.placements)} -> "
                                f"{describe(new_layout.placements)} is not all-reduces only")
    for n, (mesh_dim, c, t) in enumerate(steps):
        last = n == len(steps) - 1
        step_layout = Layout.trusted(mesh, layout.shape, tuple(placements_now))
        local = _transition(local, step_layout, mesh_dim, c, t, async_op and last, in_place)
        placements_now[mesh_dim] = t
    if async_op and not isinstance(local, Work):
        local = Work(Pending(), lambda done=local: done)
    return local, new_layout


@functools.lru_cache(maxsize=4096)
def _steps(current, target, mesh_shape):
    """The transitions (mesh dim, from, to) that take `current` placements to `target`, leaving
    out those along mesh dimensions of one rank (they move no data)."""
    current = list(current)
    dirty = _plan(current, target)
    steps = []
    # phase 1, innermost first: everything that changes goes to Replicated (or directly to its
    # target when one collective does it safely)
    for i in reversed(dirty):
        c, t = current[i], target[i]
        if isinstance(c, Replicated):
            continue
        if isinstance(c, Partial) and isinstance(t, Shard) and c.op == "sum" and \
                _direct_ok(current, list(target), i, {t.dim}):
            steps.append((i, c, t))
            current[i] = t
        elif isinstance(c, Shard) and isinstance(t, Shard) and \
                _direct_ok(current, list(target), i, {c.dim, t.dim}):
            steps.append((i, c, t))
            current[i] = t
        else:
            steps.append((i, c, Replicated()))
            current[i] = Replicated()
    # phase 2, outermost first: from Replicated to the target
    for i in dirty:
        if current[i] != target[i]:
            steps.append((i, current[i], target[i]))
            current[i] = target[i]
    return tuple(step for step in steps if mesh_shape[step[0]] > 1)


def _transition(local, layout, mesh_dim, c, t, async_op, in_place=False):
    group = layout.mesh.get_process_group(mesh_dim)
    if isinstance(c, Shard) and isinstance(t, Replicated):
        sizes = layout.extents_along(mesh_dim, c.dim)
        return group.all_gather(local, dim=c.dim, sizes=sizes, async_op=async_op)
    if isinstance(c, Replicated) and isinstance(t, Shard):
        return _slice_local(local, t.dim, group.size, group.rank)
    if isinstance(c, Partial) and isinstance(t, Replicated):
        return group.all_reduce(local, op=c.op, async_op=async_op, in_place=in_place)
    if isinstance(c, Partial) and isinstance(t, Shard):
        return group.reduce_scatter(local, dim=t.dim, op=c.op, async_op=async_op)
    if isinstance(c, Shard) and isinstance(t, Shard):
        return _all_to_all(local, layout, mesh_dim, c.dim, t.dim, group, async_op)
    if isinstance(c, Replicated) and isinstance(t, Partial):
        if t.op == "sum" and group.rank != 0:
            return backend.xp.zeros_like(local)
        return local
    raise RedistributeError(f"no transition from {c} to {t}")


def _all_to_all(local, layout, mesh_dim, from_dim, to_dim, group, async_op):
    """S(from_dim) → S(to_dim) on one mesh dim: send rank j my chunk j of `to_dim`."""
    xp = backend.xp
    pieces = [xp.ascontiguousarray(_slice_local(local, to_dim, group.size, j))
              for j in range(group.size)]
    from_extents = layout.extents_along(mesh_dim, from_dim)
    mine = pieces[group.rank].shape
    shapes = [mine[:from_dim] + (n,) + mine[from_dim + 1:] for n in from_extents]
    received = group.all_to_all(pieces, out_shapes=shapes, async_op=async_op)
    if async_op:
        return Work(Pending(received.wait, received.is_completed),
                    lambda: xp.concatenate(received.wait(), axis=from_dim))
    return xp.concatenate(received, axis=from_dim)


def check_same_mesh(op, tensors):
    first = tensors[0].mesh
    for t in tensors:
        if t.mesh is not first:
            break
    else:
        return
    meshes = [t.mesh for t in tensors]
    if any(m is not first and m != first for m in meshes[1:]):
        raise RedistributeError(f"{op}: inputs live on different meshes "
                                f"({', '.join(repr(m) for m in meshes)}); redistribute them onto "
                                "one mesh first")


def describe_layouts(tensors):
    return ", ".join(f"{t.shape}{describe(t.placements)}" for t in tensors)
