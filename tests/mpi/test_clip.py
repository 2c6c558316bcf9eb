"""Global-norm clipping and optimizer steps on sharded parameters: mixed placements on 1-D and 2-D
meshes and a sub-mesh, uneven sizes (some ranks hold empty shards), each gradient counted once;
checked against NumPy on the global arrays and against the same steps on one rank. Also optimizer
states saved from one sharding and loaded into another."""
import math

import numpy
import pytest

import cupytp
from cupytp import backend
from cupytp.optim import SGD, AdamW, clip_grad_norm_, decay_groups
from cupytp.tensor import Replicated, Shard
from dense_reference import full, lay_out, rng_array

S0, S1, R = Shard(0), Shard(1), Replicated()


def layouts(mesh1d, mesh2d):
    """(shape, mesh, placements) of a parameter set spanning two meshes and a sub-mesh."""
    return [
        ((7, 5), mesh1d, (S0,)),
        ((5, 3), mesh1d, (S1,)),
        ((5,), mesh1d, (R,)),
        ((3,), mesh1d, (S0,)),              # empty shards on 4 ranks
        ((2, 3, 5), mesh1d, (R,)),
        ((9, 7), mesh2d, (S0, S1)),
        ((6, 5), mesh2d, (R, S0)),
        ((4, 7), mesh2d, (S1, R)),
        ((11,), mesh2d, (S0, S0)),
        ((3, 3), mesh2d, (R, R)),
        ((7,), mesh2d["tp"], (S0,)),       # a parameter of the sub-mesh: not reduced over dp
    ]


def make_params(specs, seed=0, dtypes=None):
    dtypes = dtypes or [numpy.float64] * len(specs)
    values = [rng_array(shape, seed + i, dtype) for i, ((shape, _, _), dtype) in
              enumerate(zip(specs, dtypes))]
    params = [lay_out(v, mesh, placements, requires_grad=True)
              for v, (_, mesh, placements) in zip(values, specs)]
    return values, params


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = lay_out(g, p.mesh, p.placements)


def global_grads(specs, step, dtypes=None):
    dtypes = dtypes or [numpy.float64] * len(specs)
    return [rng_array(shape, 100 * (step + 1) + i, dtype)
            for i, ((shape, _, _), dtype) in enumerate(zip(specs, dtypes))]


def numpy_norm(grads, norm_type):
    flat = numpy.concatenate([g.astype(numpy.float64).ravel() for g in grads])
    return numpy.abs(flat).max() if norm_type == math.inf else numpy.sqrt(numpy.sum(flat ** 2))


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("shrink", [True, False], ids=["clipped", "unclipped"])
def test_clip_counts_each_gradient_once(mesh1d, mesh2d, norm_type, shrink):
    specs = layouts(mesh1d, mesh2d)
    _, params = make_params(specs)
    grads = global_grads(specs, 0)
    set_grads(params, grads)
    expected = numpy_norm(grads, norm_type)
    max_norm = expected / 3 if shrink else expected * 2
    norm = clip_grad_norm_(params, max_norm, norm_type=norm_type)
    assert isinstance(norm, backend.xp.ndarray) and norm.shape == ()
    numpy.testing.assert_allclose(backend.asnumpy(norm), expected, rtol=1e-13)
    factor = min(1.0, max_norm / (expected + 1e-6))
    for p, g in zip(params, grads):
        numpy.testing.assert_allclose(full(p.grad), g * factor, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_clip_low_precision_gradients(mesh1d, mesh2d, norm_type):
    """float32 and bfloat16 gradients: the norm is accumulated per dtype in float32."""
    specs = layouts(mesh1d, mesh2d)
    dtypes = [[numpy.float32, backend.bfloat16][i % 2] for i in range(len(specs))]
    _, params = make_params(specs, dtypes=[numpy.float32] * len(specs))
    grads = global_grads(specs, 0, dtypes)
    set_grads(params, grads)
    expected = numpy_norm(grads, norm_type)
    norm = clip_grad_norm_(params, 1.0, norm_type)
    assert norm.dtype == numpy.float32
    numpy.testing.assert_allclose(backend.asnumpy(norm), expected, rtol=1e-5)
    for p, g, dtype in zip(params, grads, dtypes):
        assert p.grad.dtype == dtype
        tolerance = 1e-2 if dtype == backend.bfloat16 else 1e-5
        numpy.testing.assert_allclose(full(p.grad).astype(numpy.float64),
                                      g.astype(numpy.float64) / expected, rtol=tolerance,
                                      atol=tolerance * 1e-2)


def test_clip_skips_parameters_without_gradients(mesh1d, mesh2d):
    specs = layouts(mesh1d, mesh2d)
    _, params = make_params(specs)
    grads = global_grads(specs, 0)
    set_grads(params[::2], grads[::2])
    norm = clip_grad_norm_(params, 0.5)
    numpy.testing.assert_allclose(backend.asnumpy(norm), numpy_norm(grads[::2], 2.0),
                                  rtol=1e-13)
    assert all(p.grad is None for p in params[1::2])
    assert float(backend.asnumpy(clip_grad_norm_(params[1::2], 1.0))) == 0.0


@pytest.mark.parametrize("make", [
    lambda params: AdamW(decay_groups(params, 0.1), lr=1e-2, betas=(0.8, 0.9)),
    lambda params: SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
], ids=["adamw", "sgd"])
def test_sharded_steps_equal_dense_steps(mesh1d, mesh2d, make):
    """Clip + step on sharded parameters gives the full tensors that one rank computes."""
    specs = layouts(mesh1d, mesh2d)
    dense_mesh = cupytp.local_mesh()
    dense_specs = [(shape, dense_mesh, (R,)) for shape, _, _ in specs]
    values, params = make_params(specs)
    _, dense_params = make_params(dense_specs)
    optimizer, dense = make(params), make(dense_params)
    for step in range(3):
        grads = global_grads(specs, step)
        set_grads(params, grads)
        set_grads(dense_params, grads)
        norm = clip_grad_norm_(params, 1.0)
        dense_norm = clip_grad_norm_(dense_params, 1.0)
        numpy.testing.assert_allclose(backend.asnumpy(norm), backend.asnumpy(dense_norm),
                                      rtol=1e-13)
        optimizer.step()
        dense.step()
    for p, q, v in zip(params, dense_params, values):
        assert p.local_shape == p.layout.local_shape
        assert not numpy.array_equal(full(q), v)
        numpy.testing.assert_allclose(full(p), full(q), rtol=1e-12, atol=1e-14)
    for p, q in zip(params, dense_params):
        for name, state in optimizer.state[p].items():
            assert state.layout == p.layout, f"{name} is laid out like its parameter"
            numpy.testing.assert_allclose(full(state), full(dense.state[q][name]), rtol=1e-12,
                                          atol=1e-14)


def test_state_dict_loads_into_other_placements(mesh2d):
    """States saved from one sharding load into parameters sharded another way (redistributed
    to each parameter's placements) and the two optimizers continue alike."""
    shapes = [(9, 7), (5,), (3, 4)]
    saved_specs = [(s, mesh2d, p) for s, p in zip(shapes, [(S0, S1), (R, S0), (S1, S0)])]
    loaded_specs = [(s, mesh2d, p) for s, p in zip(shapes, [(R, S0), (S0, R), (R, R)])]
    _, params = make_params(saved_specs)
    _, other = make_params(loaded_specs)
    optimizer, resumed = AdamW(params, lr=1e-2), AdamW(other, lr=1e-2)
    for step in range(4):
        grads = global_grads(saved_specs, step)
        set_grads(params, grads)
        optimizer.step()
        if step == 1:
            for p, q in zip(params, other):
                q._local[...] = p.redistribute(q.placements).to_local()
            resumed.load_state_dict(optimizer.state_dict())
        if step >= 2:
            set_grads(other, grads)
            resumed.step()
    for q in other:
        assert all(state.layout == q.layout for state in resumed.state[q].values())
    for p, q in zip(params, other):
        numpy.testing.assert_allclose(full(q), full(p), rtol=1e-12, atol=1e-14)
