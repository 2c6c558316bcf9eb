"""Activation recomputation (`nn.recompute`, GPT2(recompute=True)): the same losses, gradients
and dropout masks as keeping the activations, on 1, 2 and 4 ranks and a 2-D mesh; fewer nodes
kept; clear errors."""
import dataclasses
import gc
import weakref

import numpy
import pytest

import cupytp
from cupytp import nn, ops
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.tensor import Replicated, Shard
from dense_reference import full, lay_out

CONFIG = GPT2Config(vocab_size=37, block_size=8, n_layer=3, n_head=4, n_embd=16, dropout=0.1)
IDS = numpy.random.default_rng(3).integers(0, CONFIG.vocab_size, size=(4, 9))


def run(mesh, recompute, steps=2, dtype=None):
    """Two forward/backward passes of a GPT-2 with dropout (float64, or float32 masters under
    autocast(dtype)): losses and gradients."""
    cupytp.manual_seed(11)
    model = GPT2(CONFIG, mesh, recompute=recompute)
    model = model.to("fp64") if dtype is None else model
    replicated = (Replicated(),) * mesh.ndim
    losses, grads = [], None
    for _ in range(steps):
        with ops.autocast(dtype):
            _, loss = model(lay_out(IDS[:, :-1], mesh, replicated),
                            lay_out(IDS[:, 1:], mesh, replicated))
        loss.backward()
        losses.append(float(full(loss)))
    grads = {name: full(p.grad) for name, p in model.named_parameters()}
    return losses, grads


@pytest.mark.parametrize("shape", ["1d", "2d"])
def test_recomputed_blocks_equal_kept_activations(world, mesh1d, mesh2d, shape):
    mesh = mesh1d if shape == "1d" else mesh2d
    if CONFIG.n_head % mesh.shape[-1]:
        pytest.skip("heads do not split")
    kept, recomputed = run(mesh, False), run(mesh, True)
    numpy.testing.assert_allclose(recomputed[0], kept[0], rtol=1e-13)
    assert recomputed[1].keys() == kept[1].keys()
    for name, want in kept[1].items():
        numpy.testing.assert_allclose(recomputed[1][name], want, rtol=1e-10, atol=1e-13,
                                      err_msg=name)


def test_recomputation_runs_in_the_first_runs_autocast_region(world, mesh1d):
    """Under autocast("bf16") the rerun in backward (outside the region) computes in bf16 too:
    the losses are those of keeping the activations bit for bit, the gradients to the last
    float32 bits (the GPU's embedding backward adds repeated ids atomically, in any order; a
    rerun in float32 would be off by bf16's 1e-2)."""
    kept, recomputed = run(mesh1d, False, dtype="bf16"), run(mesh1d, True, dtype="bf16")
    numpy.testing.assert_array_equal(recomputed[0], kept[0])
    for name, want in kept[1].items():
        numpy.testing.assert_allclose(recomputed[1][name], want, rtol=1e-5, atol=1e-7,
                                      err_msg=name)


def test_recompute_keeps_only_the_input_and_replays_the_dropout(world, mesh1d):
    """The recorded graph of a recomputed piece is one node; what the piece computed inside is
    gone after the forward pass; the dropout mask of the rerun is the first run's."""
    x = lay_out(numpy.random.default_rng(4).standard_normal((6, 8)), mesh1d,
                (Shard(0),), requires_grad=True)
    w = lay_out(numpy.random.default_rng(5).standard_normal((8, 8)), mesh1d, (Replicated(),),
                requires_grad=True)
    inside = []

    def piece(v):
        h = ops.matmul(v, w)
        inside.append(weakref.ref(h))
        return ops.dropout(ops.tanh(h), 0.5)

    cupytp.manual_seed(7)
    out = nn.recompute(piece, x)
    gc.collect()
    assert out._node.name == "recompute" and inside[0]() is None
    (out * out).sum().backward()
    grad_x, grad_w = full(x.grad), full(w.grad)
    x.grad = w.grad = None
    cupytp.manual_seed(7)
    again = piece(x)
    numpy.testing.assert_array_equal(full(again), full(out))
    (again * again).sum().backward()
    numpy.testing.assert_allclose(full(x.grad), grad_x, rtol=1e-13)
    numpy.testing.assert_allclose(full(w.grad), grad_w, rtol=1e-13)


def test_recompute_needs_one_tensor_out(world, mesh1d):
    x = lay_out(numpy.ones((2, 2)), mesh1d, (Replicated(),), requires_grad=True)
    with pytest.raises(TypeError, match="must return one DTensor"):
        nn.recompute(lambda v: (v, v), x)
    y = lay_out(numpy.ones((2, 2)), mesh1d, (Replicated(),))
    assert nn.recompute(lambda v: v * 2.0, y)._node is None     # nothing to differentiate
