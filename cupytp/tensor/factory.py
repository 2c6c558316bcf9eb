"""Making DTensors: distribute a full array, wrap local parts, or build in place.

`distribute` moves a source rank's array out mesh dimension by mesh dimension (scatter for
Shard, broadcast for Replicated), so no rank but the source ever holds the whole array. The
builders (`zeros`, `randn`, ...) make only this rank's block; `randn` and `rand` draw from the
counter-based generator (one kernel on a GPU), so their global values do not depend on the
placements. Inside `deferred_init()` they allocate nothing and return recipes
(`cupytp.tensor.deferred`).
"""

import numpy

from cupytp import backend
from cupytp.distributed import runtime as rt
from cupytp.distributed.process_group import debug_enabled
from cupytp.tensor import deferred
from cupytp.tensor.dtensor import DTensor
from cupytp.tensor.layout import Layout
from cupytp.tensor.placement import Partial, Replicated, Shard, describe
from cupytp.tensor.random import default_generator


def local_mesh():
    """A one-rank mesh holding only this process (no communication ever)."""
    from cupytp.distributed.device_mesh import DeviceMesh
    group = rt.self_group()
    return DeviceMesh._view(numpy.array([group.ranks[0]]), ("self",), (0,), [group])


def _mesh_and_placements(mesh, placements):
    mesh = local_mesh() if mesh is None else mesh
    if placements is None:
        placements = (Replicated(),) * mesh.ndim
    return mesh, tuple(placements)


def _shape(shape):
    if isinstance(shape, (int, numpy.integer)):
        return (int(shape),)
    return tuple(int(n) for n in shape)


def distribute(array, mesh=None, placements=None, src=0, requires_grad=False):
    """A DTensor from `array` held by global rank `src` (other ranks may pass None).

    Placements may be Shard or Replicated; Partial values come from ops, not from here.
    """
    mesh, placements = _mesh_and_placements(mesh, placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError("distribute: Partial placements come from ops; distribute Replicated "
                         "and redistribute, or build parts with DTensor.from_local")
    info = rt.get_runtime()
    src_coordinate = tuple(int(c) for c in numpy.argwhere(mesh.mesh == src)[0]) \
        if (mesh.mesh == src).any() else None
    if src_coordinate is None:
        raise ValueError(f"distribute: source rank {src} is not in {mesh}")
    mine = info.rank == src
    if mine and array is None:
        raise ValueError("distribute: the source rank must pass the array")
    meta = (tuple(array.shape), numpy.dtype(array.dtype)) if mine else None
    shape, dtype = rt.broadcast_object(meta, src)
    local = backend.asarray(array) if mine else None
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(placements):
        # ranks that hold data (all dims after `dim` at the source's coordinate) pass it on
        if coordinate[dim + 1:] != src_coordinate[dim + 1:]:
            continue
        group = mesh.get_process_group(dim)
        root = src_coordinate[dim]
        partial_layout = Layout(mesh, shape, placements[:dim] + (Replicated(),) *
                                (mesh.ndim - dim))
        block = partial_layout.local_shape
        if isinstance(placement, Shard):
            local = group.scatter(local, src=root, dim=placement.dim, shape=block, dtype=dtype)
        elif group.rank == root:
            local = group.broadcast(local, src=root)
        else:
            local = group.broadcast(backend.xp.empty(block, dtype=dtype), src=root)
    layout = Layout(mesh, shape, placements)
    return DTensor(backend.xp.ascontiguousarray(local), layout, requires_grad=requires_grad)


def from_local(local, mesh=None, placements=None, shape=None, requires_grad=False,
               run_check=None):
    """A DTensor whose part on this rank is `local`.

    Without `shape`, the global shape comes from every rank's local shape (one small host
    all-gather per mesh dimension), and the ranks' arrays must fit one global tensor: equal dtype
    and extents except along sharded dimensions, shards of numpy.array_split sizes; otherwise
    every rank raises the same error. `run_check` (default: on under CUPYTP_DEBUG=1) also
    checks a given `shape` that way, and that Replicated parts hold the same values on every
    rank (a broadcast along each Replicated mesh dimension, compared bit for bit; not when a
    Partial placement makes the parts terms of sums, which may differ between replicas).
    """
    mesh, placements = _mesh_and_placements(mesh, placements)
    local = backend.asarray(local)
    run_check = debug_enabled() if run_check is None else run_check
    if shape is None or run_check:
        shape = _checked_shape(local, mesh, placements, shape)
    layout = Layout(mesh, _shape(shape), placements)
    if tuple(local.shape) != layout.local_shape:
        raise ValueError(f"from_local: this rank's array has shape {local.shape}, but {layout} "
                         f"gives it {layout.local_shape} (shards follow numpy.array_split sizes;"
                         " pass the right shape=)")
    if run_check and not any(p.is_partial() for p in layout.placements):
        _check_replicas(local, layout)
    return DTensor(local, layout, requires_grad=requires_grad)


def _gather_grid(mesh, item):
    """Every mesh rank's `item`, as a nested list indexed by mesh coordinate (one host
    all-gather along each mesh dimension, innermost first)."""
    for dim in reversed(range(mesh.ndim)):
        item = mesh.get_process_group(dim).all_gather_object(item)
    return item


def _checked_shape(local, mesh, placements, shape):
    """The global shape that every rank's local shape fits (the same on every rank), or the same
    ValueError on every rank."""
    grid = _gather_grid(mesh, (tuple(local.shape), str(local.dtype),
                               None if shape is None else _shape(shape)))
    seen = {coordinate: _grid_item(grid, coordinate) for coordinate in numpy.ndindex(*mesh.shape)}
    ranks = {coordinate: int(mesh.mesh[coordinate]) for coordinate in seen}

    def fail(why):
        listed = ", ".join(f"rank {ranks[c]} {s} {d}" for c, (s, d, _) in seen.items())
        raise ValueError(f"from_local: the ranks' arrays do not fit one global tensor with "
                         f"placements {describe(placements)}: {why} (the ranks give {listed}). "
                         "Only sharded dimensions may differ, by numpy.array_split sizes")
    if len({(len(s), d) for s, d, _ in seen.values()}) > 1:
        fail("their dtypes or numbers of dimensions differ")
    if len({given for _, _, given in seen.values()}) > 1:
        fail(f"they pass different shapes= ({sorted({g for _, _, g in seen.values()}, key=str)})")
    first = seen[(0,) * mesh.ndim]
    layout = Layout(mesh, first[0], placements)        # validates the placements
    if shape is None:
        shape = list(first[0])
        for d in range(len(shape)):
            along = [m for m, p in enumerate(layout.placements) if p.is_shard(d)]
            shape[d] = sum(seen[c][0][d] for c in seen
                           if all(c[m] == 0 for m in range(mesh.ndim) if m not in along))
        layout = Layout(mesh, shape, placements)
    else:
        layout = Layout(mesh, _shape(shape), placements)
    for coordinate, (local_shape, _, _) in seen.items():
        if layout.local_block(coordinate)[1] != local_shape:
            fail(f"rank {ranks[coordinate]} has {local_shape} where the global shape "
                 f"{layout.shape} gives it {layout.local_block(coordinate)[1]}")
    return layout.shape


def _grid_item(grid, coordinate):
    for index in coordinate:
        grid = grid[index]
    return grid


def _check_replicas(local, layout):
    """Along every mesh dimension where `layout` is Replicated, this rank's array equals the
    first rank's bit for bit; otherwise every rank raises the same error."""
    xp = backend.xp
    for dim, p in enumerate(layout.placements):
        group = layout.mesh.get_process_group(dim)
        if not p.is_replicated() or group.size == 1:
            continue
        first = group.broadcast(xp.ascontiguousarray(local), src=0)
        same = bool(xp.array_equal(first.reshape(-1).view(numpy.uint8),
                                   xp.ascontiguousarray(local).reshape(-1).view(numpy.uint8)))
        difference = 0.0 if same else float(xp.abs(first.astype(numpy.float64) -
                                                    local.astype(numpy.float64)).max())
        verdicts = group.all_gather_object((same, difference))
        differing = [(group.ranks[r], d) for r, (ok, d) in enumerate(verdicts) if not ok]
        if differing:
            listed = ", ".join(f"global rank {r} (max |difference| {d:.3g})"
                               for r, d in differing)
            raise ValueError(
                f"from_local(run_check=True): the arrays are Replicated along mesh dimension "
                f"{layout.mesh.dim_names[dim]!r}, but {listed} hold{'s' * (len(differing) == 1)}"
                f" other values than global rank {group.ranks[0]}: give every rank the same "
                "values, or use a Shard or Partial placement")


def _build(shape, mesh, placements, fill, requires_grad, generator=None):
    """This rank's block of `fill(global shape, offsets, local shape)`; inside deferred_init()
    a recipe instead (`generator`: the random generator `fill` draws from)."""
    mesh, placements = _mesh_and_placements(mesh, placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError("builders make Shard or Replicated tensors, not Partial")
    layout = Layout(mesh, _shape(shape), placements)
    if deferred.is_deferring():
        return deferred.build(layout, fill, requires_grad, generator)
    offsets, local_shape = layout.local_block()
    return DTensor(fill(layout.shape, offsets, local_shape), layout, requires_grad=requires_grad)


def full(shape, value, mesh=None, placements=None, dtype="fp32", requires_grad=False):
    dtype = backend.dtype(dtype)
    return _build(shape, mesh, placements,
                  lambda s, o, local: backend.xp.full(local, value, dtype=dtype), requires_grad)


def zeros(shape, mesh=None, placements=None, dtype="fp32", requires_grad=False):
    return full(shape, 0, mesh, placements, dtype, requires_grad)


def ones(shape, mesh=None, placements=None, dtype="fp32", requires_grad=False):
    return full(shape, 1, mesh, placements, dtype, requires_grad)


def arange(stop, mesh=None, placements=None, dtype="int64"):
    """0, 1, ..., stop-1 as a 1-D DTensor."""
    dtype = backend.dtype(dtype)
    return _build((stop,), mesh, placements, lambda s, o, local: backend.xp.arange(
        o[0], o[0] + local[0]).astype(dtype), False)


def randn(shape, mesh=None, placements=None, dtype="fp32", std=1.0, generator=None,
          requires_grad=False):
    """Normal(0, std) values; the same global tensor for any mesh and placements."""
    generator = generator or default_generator
    dtype = backend.dtype(dtype)
    return _build(shape, mesh, placements, lambda s, o, local: generator.normal(
        s, o, local, dtype, std), requires_grad, generator)


def rand(shape, mesh=None, placements=None, dtype="fp32", generator=None, requires_grad=False):
    """Uniform [0, 1) values; the same global tensor for any mesh and placements."""
    generator = generator or default_generator
    dtype = backend.dtype(dtype)
    return _build(shape, mesh, placements, lambda s, o, local: generator.uniform(
        s, o, local, dtype), requires_grad, generator)


