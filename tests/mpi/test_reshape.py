"""reshape with size-1 dimensions on every mesh (1-D, 2-D, and meshes with a dimension of size
one): it succeeds exactly when some output layout holds every rank's block unchanged (a search
over layouts decides, from element indices), and then equals the dense reshape, values and
gradients; otherwise it is a ShardingError."""
import itertools

import numpy
import pytest

import cupytp
from cupytp.ops import ShardingError
from cupytp.tensor import Layout, Replicated, Shard
from dense_reference import check_against_dense, lay_out, placements_for, rng_array

PAIRS = [
    ((1, 4, 3, 8), (1, 4, 3, 2, 4)),       # attention's q|k|v split with a batch of one
    ((1, 6, 4), (1, 24)),
    ((1, 6, 4), (6, 4)),
    ((1, 6, 4), (1, 1, 6, 4)),
    ((3, 1, 4), (3, 4)),
    ((3, 1, 4), (12,)),
    ((2, 1), (2,)),
    ((2, 1), (1, 2, 1)),
    ((1, 1), (1,)),
]


@pytest.fixture(scope="module", params=["1d", "2d", "1xN", "Nx1"])
def any_mesh(request, mesh1d, mesh2d):
    n = mesh1d.size()
    return {"1d": lambda: mesh1d, "2d": lambda: mesh2d,
            "1xN": lambda: cupytp.DeviceMesh((1, n), ("dp", "tp")),
            "Nx1": lambda: cupytp.DeviceMesh((n, 1), ("dp", "tp"))}[request.param]()


def flat_blocks(shape, placements, mesh):
    """Every rank's block as the row-major global indices it holds, in its own order."""
    index = numpy.arange(int(numpy.prod(shape))).reshape(shape)
    layout = Layout(mesh, shape, placements)
    blocks = []
    for coordinate in numpy.ndindex(*mesh.shape):
        offsets, extents = layout.local_block(coordinate)
        blocks.append(index[tuple(slice(o, o + e) for o, e in zip(offsets, extents))].ravel())
    return blocks


def some_layout_fits(source, target, placements, mesh):
    """True when some output placements give every rank the same elements in the same order as
    its input block: each sharded input dimension moved whole to an output dimension of its own
    (the Shard of every mesh dimension that splits it), or, when only mesh dimensions of one
    rank split it, made Replicated there."""
    held = flat_blocks(source, placements, mesh)
    sharded = sorted({p.dim for p in placements if isinstance(p, Shard)})
    options = []
    for d in sharded:
        single = all(n == 1 for p, n in zip(placements, mesh.shape) if p == Shard(d))
        options.append([Shard(e) for e in range(len(target))] + ([Replicated()] if single else []))
    for moves in itertools.product(*options):
        landed = [m.dim for m in moves if isinstance(m, Shard)]
        if len(set(landed)) < len(landed):
            continue
        moved = dict(zip(sharded, moves))
        out = [moved[p.dim] if isinstance(p, Shard) else p for p in placements]
        if all(numpy.array_equal(a, b) for a, b in zip(held, flat_blocks(target, out, mesh))):
            return True
    return False


@pytest.mark.parametrize("source,target", PAIRS)
def test_reshape_with_size_one_dimensions(any_mesh, source, target):
    value = rng_array(source, 1)
    for placements in placements_for(any_mesh, len(source)):
        if some_layout_fits(source, target, placements, any_mesh):
            check_against_dense(lambda v: v.reshape(target), [value], [placements], any_mesh)
        else:
            with pytest.raises(ShardingError, match="reshape"):
                lay_out(value, any_mesh, placements).reshape(target)
