"""Layout: a global shape laid over a DeviceMesh, one placement per mesh dimension.

Gives every rank's local shape and global offsets. Several mesh dimensions may shard the same
tensor dimension: they split it in mesh-dimension order (the first splits the whole, the next
splits that chunk).
"""
from functools import lru_cache

from cupytp.distributed.process_group import split_sizes
from cupytp.tensor.placement import Placement, Shard, describe


class LayoutError(ValueError):
    """A layout that cannot exist: wrong placement count, a dimension out of range, ..."""


class Layout:
    __slots__ = ("mesh", "shape", "placements", "_local")

    def __init__(self, mesh, shape, placements):
        shape = tuple(int(n) for n in shape)
        self.mesh = mesh
        self.shape = shape
        self.placements = _normalized(shape, placements, mesh.ndim)
        self._local = None

    @classmethod
    def trusted(cls, mesh, shape, placements):
        """A Layout from an op's own shape tuple and normalized placements tuple (Shard dims
        non-negative, one per mesh dimension), without re-checking them."""
        layout = cls.__new__(cls)
        layout.mesh, layout.shape, layout.placements, layout._local = \
            mesh, shape, placements, None
        return layout

    @property
    def ndim(self):
        return len(self.shape)

    def local_block(self, coordinate=None):
        """(offsets, local shape) of the rank at mesh `coordinate` (default: this rank)."""
        if coordinate is None:
            if self._local is None:
                self._local = _block(self.shape, self.placements, self.mesh.shape,
                                     self.mesh.get_coordinate())
            return self._local
        return _block(self.shape, self.placements, self.mesh.shape, tuple(coordinate))

    @property
    def local_shape(self):
        return self.local_block()[1]

    @property
    def offsets(self):
        return self.local_block()[0]

    def extents_along(self, mesh_dim, tensor_dim):
        """Extent of `tensor_dim` on each rank of this rank's line along `mesh_dim`."""
        coordinate = list(self.mesh.get_coordinate())
        extents = []
        for index in range(self.mesh.shape[mesh_dim]):
            coordinate[mesh_dim] = index
            extents.append(self.local_block(coordinate)[1][tensor_dim])
        return extents

    def with_placements(self, placements):
        return Layout.trusted(self.mesh, self.shape,
                              _normalized(self.shape, placements, self.mesh.ndim))

    def is_replicated(self):
        return all(p.is_replicated() for p in self.placements)

    def sharded_dims(self):
        """Tensor dimensions that some mesh dimension shards."""
        return {p.dim for p in self.placements if isinstance(p, Shard)}

    def __eq__(self, other):
        return (isinstance(other, Layout) and self.shape == other.shape
                and self.placements == other.placements and self.mesh == other.mesh)

    def __hash__(self):
        return hash((self.shape, self.placements))

    def __repr__(self):
        return f"Layout(shape={self.shape}, placements={describe(self.placements)}, " \
               f"mesh={self.mesh.shape})"


_checked = {}          # (placements, tensor ndim, mesh ndim) -> normalized placements


def _normalized(shape, placements, mesh_ndim):
    """`placements` (checked) as a tuple with Shard dims made non-negative."""
    placements = tuple(placements)
    try:
        normalized = _checked.get((placements, len(shape), mesh_ndim))
    except TypeError:             # something unhashable: not a placement, said by _check
        normalized = None
    return _check(shape, placements, mesh_ndim) if normalized is None else normalized


def _check(shape, placements, mesh_ndim):
    """`placements` with Shard dims made non-negative, or a LayoutError saying what is wrong."""
    if len(placements) != mesh_ndim:
        raise LayoutError(f"{len(placements)} placements {describe(placements)} for a "
                          f"{mesh_ndim}-D mesh: give one placement per mesh dimension")
    normalized = []
    for p in placements:
        if not isinstance(p, Placement):
            raise LayoutError(f"{p!r} is not a placement: use Shard(dim), Replicated() or "
                              "Partial()")
        if isinstance(p, Shard):
            if not -len(shape) <= p.dim < len(shape):
                raise LayoutError(f"{p} is out of range for a tensor of shape {shape}")
            p = Shard(p.dim % len(shape))
        normalized.append(p)
    normalized = tuple(normalized)
    _checked[placements, len(shape), mesh_ndim] = normalized
    return normalized


@lru_cache(maxsize=65536)
def _block(shape, placements, mesh_shape, coordinate):
    offsets = [0] * len(shape)
    extents = list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            sizes = split_sizes(extents[p.dim], mesh_shape[mesh_dim])
            index = coordinate[mesh_dim]
            offsets[p.dim] += sum(sizes[:index])
            extents[p.dim] = sizes[index]
    return tuple(offsets), tuple(extents)
