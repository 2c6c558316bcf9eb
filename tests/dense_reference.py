"""Test helpers: lay a global NumPy array out on a mesh, and check a sharded computation
against the same computation on one rank (forward values and input gradients)."""
import itertools

import numpy

import cupytp
from cupytp import backend
from cupytp.tensor import Layout, Partial, Replicated, Shard, from_local, local_mesh


def lay_out(array, mesh, placements, requires_grad=False, seed=0):
    """The DTensor whose global value is `array` (the same on every rank), with `placements`.
    Partial placements split the value into random parts that add up to it."""
    array = numpy.asarray(array)
    layout = Layout(mesh, array.shape, placements)
    offsets, local_shape = layout.local_block()
    block = array[tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))].copy()
    coordinate = mesh.get_coordinate()
    for dim, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            size = mesh.shape[dim]
            noise = [numpy.random.default_rng([seed, dim, j, *coordinate[:dim]]).standard_normal(
                block.shape).astype(array.dtype) for j in range(1, size)]
            index = coordinate[dim]
            block = block - sum(noise) if index == 0 and noise else \
                (noise[index - 1] if index else block)
    return from_local(backend.asarray(block), mesh, layout.placements, shape=array.shape,
                      requires_grad=requires_grad)


def full(x):
    """The global value of `x` as a NumPy array of its own (a copy: a data-parallel gradient is
    a view of a bucket that the next backward overwrites)."""
    return numpy.array(backend.asnumpy(x.full_tensor()), copy=True)


def check_against_dense(fn, arrays, placements, mesh, rtol=1e-10, atol=1e-12, grad=True,
                        seed=0):
    """Run `fn` on `arrays` laid out with `placements` and on one rank; compare the outputs and
    (with a random output gradient) the gradients of every floating input.

    The gradient check runs twice: the loss weight Replicated, then Partial, so that Partial
    gradients flow back into the op wherever its output is Replicated."""
    def run(mesh_, placements_, weight_placement):
        inputs = [lay_out(a, mesh_, p, requires_grad=grad and a.dtype.kind == "f", seed=seed)
                  for a, p in zip(arrays, placements_)]
        out = fn(*inputs)
        if grad:
            weight = numpy.random.default_rng(seed + 7).standard_normal(out.shape)
            w = lay_out(weight.astype(out.dtype), mesh_, (weight_placement,) * mesh_.ndim,
                        seed=seed + 1)
            (out * w).sum().backward()
        return full(out), [full(t.grad) if t.requires_grad else None for t in inputs]

    dense = local_mesh()
    expected, expected_grads = run(dense, [(Replicated(),)] * len(arrays), Replicated())
    for weight_placement in ((Replicated(), Partial()) if grad else (Replicated(),)):
        actual, grads = run(mesh, placements, weight_placement)
        numpy.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)
        for got, want in zip(grads, expected_grads):
            if want is not None:
                numpy.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                              err_msg=f"gradient, loss weight {weight_placement}")
    return actual


def placements_for(mesh, ndim, partial=True):
    """Every placement tuple for a tensor of `ndim` dims on `mesh` (no Partial if asked)."""
    options = [Replicated()] + [Shard(d) for d in range(ndim)] + ([Partial()] if partial else [])
    return list(itertools.product(options, repeat=mesh.ndim))


def rng_array(shape, seed, dtype=numpy.float64):
    return numpy.random.default_rng(seed).standard_normal(shape).astype(dtype)


__all__ = ["cupytp", "lay_out", "full", "check_against_dense", "placements_for", "rng_array"]


def step_on_gradients(params, optimizer, grad_steps, scaler=None):
    """Optimizer steps on given full gradients (a None entry: no step at all); with a GradScaler,
    each gradient arrives as the scaled loss's backward would give it (times the scale: a
    non-finite one stays so) and the scaler steps and updates. The parameters after, full."""
    for grads in grad_steps:
        if grads is None:
            continue
        scale = 1.0 if scaler is None else scaler.get_scale()
        for p, g in zip(params, grads):
            p.grad = lay_out((g * scale).astype(g.dtype), p.mesh, p.placements)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
    return [full(p) for p in params]
