"""Every redistribute transition, forward and backward, on 1-D and 2-D meshes, uneven sizes;
a Partial gradient along a mesh dimension the redistribution left alone stays Partial."""
import numpy
import pytest

import cupytp
from cupytp import backend
from cupytp.debug import CommTracer
from cupytp.tensor import Partial, Replicated, Shard
from dense_reference import full, lay_out, placements_for, rng_array


@pytest.mark.parametrize("shape", [(7, 5), (3, 2, 5)])
def test_every_transition(mesh, shape):
    value = rng_array(shape, 1)
    grad_out = rng_array(shape, 2)
    options = placements_for(mesh, len(shape))
    for source in options:
        for target in options:
            x = lay_out(value, mesh, source, requires_grad=True)
            y = x.redistribute(target)
            assert y.placements == tuple(target)
            assert y.local_shape == y.layout.local_shape
            numpy.testing.assert_allclose(full(y), value, rtol=1e-13, atol=1e-13,
                                          err_msg=f"{source} -> {target}")
            w = lay_out(grad_out, mesh, (Replicated(),) * mesh.ndim)
            (y * w).sum().backward()
            assert x.grad.placements == tuple(Replicated() if p.is_partial() else p
                                              for p in source)
            numpy.testing.assert_allclose(full(x.grad), grad_out, rtol=1e-13, atol=1e-13,
                                          err_msg=f"grad of {source} -> {target}")


def test_collectives_named_by_the_table(mesh1d):
    """One collective per transition on a 1-D mesh: gather, slice, reduce, reduce-scatter."""
    value = rng_array((5, 4), 3)
    x = lay_out(value, mesh1d, (Partial(),))
    y = x.redistribute((Shard(0),))
    expected = numpy.array_split(value, mesh1d.size(), axis=0)[mesh1d.get_coordinate()[0]]
    numpy.testing.assert_allclose(backend.asnumpy(y.to_local()), expected, rtol=1e-13)


def test_async_redistribute(mesh):
    value = rng_array((6, 3), 4)
    x = lay_out(value, mesh, (Shard(0),) * mesh.ndim)
    work = x.redistribute((Replicated(),) * mesh.ndim, async_op=True)
    y = work.wait()
    numpy.testing.assert_allclose(backend.asnumpy(y.to_local()), value, rtol=1e-13)


def test_partial_max(mesh1d):
    value = rng_array((4, 6), 5)
    x = lay_out(value, mesh1d, (Shard(1),))
    m = x.max(1)
    assert m.placements == (Partial("max"),)
    numpy.testing.assert_allclose(full(m), value.max(1), rtol=1e-13)


def test_a_partial_gradient_stays_partial_where_nothing_changed(world):
    """x Replicated on a (dp, tp) mesh, redistributed along tp alone, meets a batch sharded along
    dp: its gradient comes back as each dp rank's sum, Partial along dp, with no dp collective
    in the backward (a parameter's is reduced by the data-parallel engine, with the others),
    and right."""
    if world.world_size % 2:
        pytest.skip("needs an even number of ranks")
    mesh = cupytp.DeviceMesh((2, world.world_size // 2), ("dp", "tp"))
    value, weights = rng_array((6, 4), 4), rng_array((4, 6, 4), 5)
    x = lay_out(value, mesh, (Replicated(), Replicated()), requires_grad=True)
    y = x.redistribute((Replicated(), Shard(0)))
    with CommTracer() as tracer:
        (y * lay_out(weights, mesh, (Shard(0), Replicated()))).sum().backward()
    dp = mesh.get_process_group("dp").name
    assert not [r for r in tracer.rows() if r.group == dp and r.phase == "backward"]
    assert x.grad.placements == (Partial(), Replicated())
    numpy.testing.assert_allclose(full(x.grad), weights.sum(0), rtol=1e-13, atol=1e-13)
