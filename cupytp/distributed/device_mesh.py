"""DeviceMesh: the ranks of the job arranged as an n-dimensional grid with named dimensions.

Each mesh dimension has one ProcessGroup per line of ranks along it; this rank belongs to one
line per dimension and holds that line's group. `mesh["tp"]` is the sub-mesh along "tp" through
this rank (sharing the parent's groups, no new communicators).
"""
import math

import numpy

from cupytp.distributed import runtime as rt


class DeviceMesh:
    """`shape` ranks per dimension (their product is the world size), named by `dim_names`.

    Ranks fill the grid in row-major order: for shape (2, 2) with names ("dp", "tp"), ranks 0 and
    1 form one "tp" group and ranks 0 and 2 one "dp" group.
    """

    def __init__(self, shape, dim_names=None):
        info = rt.get_runtime()
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(n) for n in shape)
        if not shape or any(n < 1 for n in shape):
            raise ValueError(f"a mesh shape needs positive sizes, got {shape}")
        if math.prod(shape) != info.world_size:
            raise ValueError(f"mesh shape {shape} holds {math.prod(shape)} ranks but the job has "
                             f"{info.world_size}: launch mpiexec -n {math.prod(shape)} or change "
                             "the shape")
        dim_names = _check_names(dim_names, len(shape))
        grid = numpy.arange(info.world_size).reshape(shape)
        coordinate = tuple(int(c) for c in numpy.unravel_index(info.rank, shape))
        groups = []
        for dim, name in enumerate(dim_names):
            others = coordinate[:dim] + coordinate[dim + 1:]
            color = int(numpy.ravel_multi_index(others, shape[:dim] + shape[dim + 1:])) \
                if others else 0
            groups.append(rt.new_group(color, coordinate[dim], name))
        self._set(grid, dim_names, coordinate, groups)

    def _set(self, grid, dim_names, coordinate, groups):
        self.mesh = grid                      # global rank at each coordinate
        self.shape = grid.shape
        self.ndim = grid.ndim
        self.dim_names = dim_names
        self._coordinate = coordinate
        self._groups = groups

    @classmethod
    def _view(cls, grid, dim_names, coordinate, groups):
        mesh = cls.__new__(cls)
        mesh._set(grid, dim_names, coordinate, groups)
        return mesh

    # ---- lookups ------------------------------------------------------------------------------
    def _dim(self, dim):
        if isinstance(dim, str):
            if dim not in self.dim_names:
                raise KeyError(f"mesh has no dimension {dim!r}; its dimensions are "
                               f"{self.dim_names}")
            return self.dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh dimension {dim} is out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def size(self, dim=None):
        """Ranks in the whole mesh, or along `dim` (index or name)."""
        return self.mesh.size if dim is None else self.shape[self._dim(dim)]

    def get_coordinate(self):
        """This rank's position in the grid."""
        return self._coordinate

    def get_local_rank(self, dim):
        """This rank's index along `dim` (its rank within that dimension's group)."""
        return self._coordinate[self._dim(dim)]

    def get_process_group(self, dim):
        """The ProcessGroup of this rank's line along `dim` (index or name)."""
        return self._groups[self._dim(dim)]

    def __getitem__(self, dims):
        """The sub-mesh over `dims` (one name/index or several) through this rank."""
        dims = [self._dim(d) for d in ((dims,) if isinstance(dims, (str, int)) else dims)]
        if len(set(dims)) != len(dims):
            raise ValueError(f"mesh dimensions {dims} repeat")
        index = tuple(slice(None) if d in dims else c for d, c in enumerate(self._coordinate))
        kept = [d for d in range(self.ndim) if d in dims]
        grid = numpy.transpose(self.mesh[index], [kept.index(d) for d in dims])
        return DeviceMesh._view(grid, tuple(self.dim_names[d] for d in dims),
                                tuple(self._coordinate[d] for d in dims),
                                [self._groups[d] for d in dims])

    def __eq__(self, other):
        return (isinstance(other, DeviceMesh) and self.dim_names == other.dim_names
                and numpy.array_equal(self.mesh, other.mesh))

    def __hash__(self):
        return hash((self.dim_names, self.mesh.tobytes(), self.shape))

    def __repr__(self):
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"DeviceMesh({dims}, ranks={self.mesh.tolist()})"


def _check_names(dim_names, ndim):
    if dim_names is None:
        return tuple(f"dim{i}" for i in range(ndim)) if ndim > 1 else ("world",)
    dim_names = (dim_names,) if isinstance(dim_names, str) else tuple(dim_names)
    if len(dim_names) != ndim or len(set(dim_names)) != ndim:
        raise ValueError(f"mesh needs {ndim} distinct dimension names, got {dim_names}")
    return dim_names


def init_device_mesh(shape, dim_names=None):
    """cupytp.init() if needed, then the DeviceMesh of `shape` over the whole job."""
    rt.init()
    return DeviceMesh(shape, dim_names)
