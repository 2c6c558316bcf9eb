"""Making DTensors: distribute a full array, wrap local parts, or build in place.

`distribute` moves a source rank's array out mesh dimension by mesh dimension (scatter for
Shard, broadcast for Replicated), so no rank but the source ever holds the whole array. The
builders (`zeros`, `randn`, ...) make only this rank's block; `randn` and `rand` draw from the
counter-based generator, so their global values do not depend on the placements.
"""

import numpy

from cupytp import backend
from cupytp.distributed import runtime as rt
from cupytp.tensor.dtensor import DTensor
from cupytp.tensor.layout import Layout
from cupytp.tensor.placement import Partial, Replicated, Shard
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
    shape, dtype = rt.world_comm().bcast(meta, root=src)
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


def from_local(local, mesh=None, placements=None, shape=None, requires_grad=False):
    """A DTensor whose part on this rank is `local`. Without `shape`, the global shape comes
    from the ranks' local extents (one small host all-gather per sharded mesh dimension)."""
    mesh, placements = _mesh_and_placements(mesh, placements)
    local = backend.asarray(local)
    if shape is None:
        extents = list(local.shape)
        probe = Layout(mesh, extents, placements)     # validates the placements
        for dim in reversed(range(mesh.ndim)):
            p = probe.placements[dim]
            if isinstance(p, Shard):
                group = mesh.get_process_group(dim)
                extents[p.dim] = sum(group.host_comm.allgather(extents[p.dim])) \
                    if group.size > 1 else extents[p.dim]
        shape = extents
    layout = Layout(mesh, _shape(shape), placements)
    if tuple(local.shape) != layout.local_shape:
        raise ValueError(f"from_local: this rank's array has shape {local.shape}, but {layout} "
                         f"gives it {layout.local_shape} (shards follow numpy.array_split sizes;"
                         " pass the right shape=)")
    return DTensor(local, layout, requires_grad=requires_grad)


def _build(shape, mesh, placements, fill, requires_grad):
    mesh, placements = _mesh_and_placements(mesh, placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError("builders make Shard or Replicated tensors, not Partial")
    layout = Layout(mesh, _shape(shape), placements)
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
    return _build(shape, mesh, placements, lambda s, o, local: (
        generator.normal(s, o, local) * std).astype(dtype), requires_grad)


def rand(shape, mesh=None, placements=None, dtype="fp32", generator=None, requires_grad=False):
    """Uniform [0, 1) values; the same global tensor for any mesh and placements."""
    generator = generator or default_generator
    dtype = backend.dtype(dtype)
    return _build(shape, mesh, placements, lambda s, o, local: generator.uniform(
        s, o, local).astype(dtype), requires_grad)


