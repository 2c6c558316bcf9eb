"""from_local: the global shape inferred from every rank's local shape, checked on every
dimension (mismatches are the same error on every rank, never silent corruption), and
run_check (on under CUPYTP_DEBUG=1) verifying that Replicated parts agree."""
import numpy
import pytest

from cupytp import backend
from cupytp.tensor import Layout, Partial, Replicated, Shard, from_local
from dense_reference import full, placements_for, rng_array


def block(array, mesh, placements):
    offsets, shape = Layout(mesh, array.shape, placements).local_block()
    return backend.asarray(array[tuple(slice(o, o + n) for o, n in zip(offsets, shape))])


def needs_ranks(mesh):
    if mesh.size() == 1:
        pytest.skip("needs several ranks")


def test_inferred_shape_any_placements(mesh):
    """Uneven sizes, nested sharding of one dimension on a 2-D mesh: the inferred global
    tensor is the one the blocks were cut from."""
    value = rng_array((5, 7, 3), 1)
    for placements in placements_for(mesh, 3, partial=False):
        x = from_local(block(value, mesh, placements), mesh, placements)
        assert x.shape == value.shape, placements
        numpy.testing.assert_array_equal(full(x), value, err_msg=str(placements))


def test_other_dimensions_must_agree(mesh1d):
    """The reported case: (2, 3) and (2, 4) sharded on dim 0 gave each rank another global
    shape, and a gather then handed out uninitialized memory."""
    needs_ranks(mesh1d)
    rank = mesh1d.get_coordinate()[0]
    local = backend.xp.ones((2, 3 + rank % 2))
    with pytest.raises(ValueError, match=r"do not fit one global tensor .*\(2, 3\).*\(2, 4\)"):
        from_local(local, mesh1d, (Shard(0),))


def test_shards_must_follow_array_split(mesh1d):
    needs_ranks(mesh1d)
    rank = mesh1d.get_coordinate()[0]
    local = backend.xp.ones((3 if rank == 0 else 1, 2))
    with pytest.raises(ValueError, match="rank 0 has \\(3, 2\\) where the global shape"):
        from_local(local, mesh1d, (Shard(0),))


def test_dtypes_must_agree(mesh2d):
    if mesh2d.size() == 1:
        pytest.skip("needs several ranks")
    first = mesh2d.get_coordinate() == (0, 0)
    local = backend.xp.ones((2, 2), dtype=numpy.float32 if first else numpy.float64)
    with pytest.raises(ValueError, match="dtypes or numbers of dimensions differ"):
        from_local(local, mesh2d, (Shard(0), Replicated()))


def test_run_check_replicated_values(mesh2d, monkeypatch):
    monkeypatch.delenv("CUPYTP_DEBUG", raising=False)
    value = rng_array((4, 3), 2)
    placements = (Replicated(), Shard(1))
    agreed = from_local(block(value, mesh2d, placements), mesh2d, placements, run_check=True)
    numpy.testing.assert_array_equal(full(agreed), value)
    differs = mesh2d.get_coordinate()[0] == 1
    local = block(value + (1.0 if differs else 0.0), mesh2d, placements)
    from_local(local, mesh2d, placements, shape=value.shape)          # not checked by default
    if mesh2d.shape[0] == 1:
        return
    with pytest.raises(ValueError, match="Replicated along mesh dimension 'dp'.*max "
                                         "\\|difference\\| 1"):
        from_local(local, mesh2d, placements, shape=value.shape, run_check=True)
    monkeypatch.setenv("CUPYTP_DEBUG", "1")
    with pytest.raises(ValueError, match="Replicated along mesh dimension 'dp'"):
        from_local(local, mesh2d, placements, shape=value.shape)
    partial = from_local(local, mesh2d, (Partial(), Shard(1)), shape=value.shape)
    assert partial.placements == (Partial(), Shard(1))


def test_run_check_given_shapes_must_agree(mesh1d):
    needs_ranks(mesh1d)
    rank = mesh1d.get_coordinate()[0]
    local = backend.xp.ones((2,))
    with pytest.raises(ValueError, match="different shapes="):
        from_local(local, mesh1d, (Replicated(),), shape=(2 + rank,),
                   run_check=True)
