"""Every collective of ProcessGroup, every dtype, uneven sizes, 1-D and 2-D meshes, against NumPy.

Each rank can build every rank's input (seeded by the group rank), so the expected result is
computed locally with NumPy. Inputs are small integers: exact in every dtype, bf16 included.
"""
import numpy
import pytest

import cupytp
from cupytp import backend

DTYPES = ["bf16", "fp16", "fp32", "fp64", "int32", "int64", "uint8"]
xp = backend.xp


def rank_input(group_rank, shape, dtype, low=0, high=8, seed=0):
    """The array group rank `group_rank` contributes (host copy)."""
    rng = numpy.random.default_rng(1000 * seed + group_rank)
    return rng.integers(low, high, size=shape).astype(backend.dtype(dtype))


def on_device(array):
    return backend.asarray(array)


def host(array):
    return backend.asnumpy(array)


def exact(actual, expected):
    actual, expected = host(actual), numpy.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    numpy.testing.assert_array_equal(actual.astype(numpy.float64),
                                     expected.astype(numpy.float64))


@pytest.fixture(params=["world", "tp", "dp"])
def group(request, mesh1d, mesh2d):
    """The world group, and both dimensions of the 2-D mesh (sub-groups on 4 ranks)."""
    if request.param == "world":
        return mesh1d.get_process_group(0)
    return mesh2d.get_process_group(request.param)


def reference_reduce(stack, op, dtype):
    dtype = backend.dtype(dtype)
    wide = stack.astype(numpy.float64)
    if op == "sum":
        return wide.sum(0).astype(dtype)
    if op == "prod":
        return wide.prod(0).astype(dtype)
    if op == "max":
        return wide.max(0).astype(dtype)
    if op == "min":
        return wide.min(0).astype(dtype)
    mean = wide.sum(0) / stack.shape[0]
    return (numpy.trunc(mean) if numpy.issubdtype(dtype, numpy.integer) else mean).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
def test_all_reduce(group, dtype, op):
    high = 3 if op == "prod" else 8
    inputs = [rank_input(r, (3, 5), dtype, 1, high) for r in range(group.size)]
    out = group.all_reduce(on_device(inputs[group.rank]), op=op)
    exact(out, reference_reduce(numpy.stack(inputs), op, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_uneven(group, dtype, dim):
    sizes = [2 + (r % 3) for r in range(group.size)]        # uneven when size > 1
    shapes = [(sizes[r], 4, 3) if dim == 0 else (4, sizes[r], 3) if dim == 1 else
              (4, 3, sizes[r]) for r in range(group.size)]
    inputs = [rank_input(r, shapes[r], dtype) for r in range(group.size)]
    out = group.all_gather(on_device(inputs[group.rank]), dim=dim, sizes=sizes)
    exact(out, numpy.concatenate(inputs, axis=dim))


def test_all_gather_even_default_sizes(group):
    inputs = [rank_input(r, (2, 3), "fp32") for r in range(group.size)]
    out = group.all_gather(on_device(inputs[group.rank]), dim=1)
    exact(out, numpy.concatenate(inputs, axis=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [7, 1, 12])
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_uneven(group, dtype, length, dim):
    shape = (length, 3) if dim == 0 else (3, length)
    inputs = [rank_input(r, shape, dtype) for r in range(group.size)]
    out = group.reduce_scatter(on_device(inputs[group.rank]), dim=dim, op="sum")
    total = reference_reduce(numpy.stack(inputs), "sum", dtype)
    exact(out, numpy.array_split(total, group.size, axis=dim)[group.rank])


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(group, dtype):
    src = group.size - 1
    expected = rank_input(src, (4, 3), dtype)
    mine = rank_input(group.rank, (4, 3), dtype)
    exact(group.broadcast(on_device(mine), src=src), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_uneven(group, dtype):
    full = rank_input(99, (2 * group.size + 1, 3), dtype)
    src = 0
    if group.rank == src:
        out = group.scatter(on_device(full), src=src, dim=0)
    else:
        out = group.scatter(None, src=src, dim=0, shape=full.shape, dtype=full.dtype)
    exact(out, numpy.array_split(full, group.size, axis=0)[group.rank])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_uneven(group, dtype):
    sizes = [1 + r for r in range(group.size)]
    inputs = [rank_input(r, (3, sizes[r]), dtype) for r in range(group.size)]
    dst = group.size // 2
    out = group.gather(on_device(inputs[group.rank]), dst=dst, dim=1, sizes=sizes)
    if group.rank == dst:
        exact(out, numpy.concatenate(inputs, axis=1))
    else:
        assert out is None or group.size == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_uneven(group, dtype):
    # rank r sends rank j a (r + j + 1, 2) block whose values identify (r, j)
    def block(r, j):
        return numpy.full((r + j + 1, 2), 10 * r + j).astype(backend.dtype(dtype))
    inputs = [on_device(block(group.rank, j)) for j in range(group.size)]
    shapes = [(r + group.rank + 1, 2) for r in range(group.size)]
    outs = group.all_to_all(inputs, out_shapes=shapes)
    for r, out in enumerate(outs):
        exact(out, block(r, group.rank))


def test_send_recv_ring(group):
    if group.size == 1:
        pytest.skip("needs two ranks")
    right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    mine = rank_input(group.rank, (5,), "fp64")
    if group.rank % 2 == 0:
        group.send(on_device(mine), right)
        got = group.recv((5,), "fp64", left)
    else:
        got = group.recv((5,), "fp64", left)
        group.send(on_device(mine), right)
    exact(got, rank_input(left, (5,), "fp64"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_isend_irecv_both_ways_at_once(group, dtype):
    """Every rank sends to both neighbours and receives from both in one batch (on 2 ranks:
    two transfers each way between the same pair, matched in order)."""
    if group.size == 1:
        pytest.skip("needs two ranks")
    right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size

    def block(src, dst):
        return rank_input(10 * src + dst, (3, src + 1), dtype)
    work = group.batch_isend_irecv(
        [(on_device(block(group.rank, right)), right), (on_device(block(group.rank, left)), left)],
        [((3, left + 1), dtype, left), ((3, right + 1), dtype, right)])
    from_left, from_right = work.wait()
    exact(from_left, block(left, group.rank))
    exact(from_right, block(right, group.rank))


def test_async_send_and_recv(group):
    if group.size == 1:
        pytest.skip("needs two ranks")
    right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    receiving = group.recv((4,), "fp32", left, async_op=True)
    sending = group.send(on_device(rank_input(group.rank, (4,), "fp32")), right, async_op=True)
    exact(receiving.wait(), rank_input(left, (4,), "fp32"))
    assert sending.wait() is None
    with pytest.raises(ValueError, match="cannot send to itself"):
        group.send(on_device(numpy.zeros(2, numpy.float32)), group.rank)
    with pytest.raises(ValueError, match="not in group"):
        group.batch_isend_irecv(recvs=[((2,), "fp32", group.size)])


def test_async_work(group):
    inputs = [rank_input(r, (64, 3), "fp32") for r in range(group.size)]
    works = [group.all_reduce(on_device(inputs[group.rank]), async_op=True),
             group.all_gather(on_device(inputs[group.rank]), dim=1, async_op=True),
             group.reduce_scatter(on_device(inputs[group.rank]), async_op=True)]
    stack = numpy.stack(inputs)
    exact(works[0].wait(), stack.sum(0))
    exact(works[1].wait(), numpy.concatenate(inputs, axis=1))
    exact(works[2].wait(), numpy.array_split(stack.sum(0), group.size)[group.rank])
    backend.synchronize()
    assert all(w.is_completed() for w in works)


def test_async_work_keeps_its_buffers_alive(group):
    """An async collective's internal buffers (the padded send buffer of uneven sizes, the
    float32 copy bf16 is reduced in) live until it completes, not only as long as the call:
    large arrays, whose memory goes back to the system and is reused at once when freed."""
    shape = (group.size * 300000 + 1, 2)
    inputs = [rank_input(r, shape, "bf16") for r in range(group.size)]
    stack = numpy.stack(inputs)
    works = [group.reduce_scatter(on_device(inputs[group.rank]), async_op=True),
             group.all_reduce(on_device(inputs[group.rank]), async_op=True)]
    litter = [xp.full(shape, 1e30, dtype=xp.float32) for _ in range(6)]
    exact(works[0].wait(), numpy.array_split(stack.sum(0), group.size)[group.rank])
    exact(works[1].wait(), stack.sum(0))
    del litter


def test_barrier_and_broadcast_object(group):
    group.barrier()
    assert group.broadcast_object({"step": group.rank}, src=0) == {"step": 0}


def test_local_errors_before_communication(group):
    with pytest.raises(TypeError, match="dtype"):
        group.all_reduce(on_device(numpy.zeros(3, numpy.complex64)))
    with pytest.raises(ValueError, match="reduce op"):
        group.all_reduce(on_device(numpy.zeros(3, numpy.float32)), op="mean")
    with pytest.raises(ValueError, match="out of range"):
        group.all_gather(on_device(numpy.zeros((2, 2), numpy.float32)), dim=2)
    with pytest.raises(ValueError, match="sizes"):
        group.all_gather(on_device(numpy.zeros((2, 2), numpy.float32)), sizes=[3] * group.size)
    with pytest.raises(ValueError, match="not in group"):
        group.broadcast(on_device(numpy.zeros(2, numpy.float32)), src=group.size)
    with pytest.raises(TypeError, match="array"):
        group.all_reduce([1.0, 2.0])


def test_mesh_coordinates_and_groups(world, mesh2d):
    dp, tp = mesh2d.shape
    coordinate = mesh2d.get_coordinate()
    assert mesh2d.mesh[coordinate] == world.rank
    assert list(mesh2d.get_process_group("tp").ranks) == mesh2d.mesh[coordinate[0], :].tolist()
    assert list(mesh2d.get_process_group("dp").ranks) == mesh2d.mesh[:, coordinate[1]].tolist()
    sub = mesh2d["tp"]
    assert sub.shape == (tp,) and sub.get_coordinate() == (coordinate[1],)
    assert sub.get_process_group(0) is mesh2d.get_process_group("tp")
    swapped = mesh2d["tp", "dp"]
    assert swapped.shape == (tp, dp)
    assert swapped.mesh[coordinate[1], coordinate[0]] == world.rank


def test_mesh_bad_input(world):
    with pytest.raises(ValueError, match="holds"):
        cupytp.DeviceMesh((world.world_size + 1,))
    with pytest.raises(ValueError, match="distinct"):
        cupytp.DeviceMesh((world.world_size, 1), ("a", "a"))
    mesh = cupytp.DeviceMesh((world.world_size,), ("tp",))
    with pytest.raises(KeyError, match="no dimension"):
        mesh.get_process_group("dp")
