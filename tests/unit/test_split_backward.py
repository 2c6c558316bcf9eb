"""Split backward (autograd engine): `backward(root, grad, inputs=[x])` gives x its gradient at
once and leaves the weights' to the DeferredBackward it returns; together they give exactly
what one backward gives, through transformer blocks (fused and chained), recomputed blocks, a
weight used twice and a leaf root. The products of the weights' gradients run only in the
deferred part."""
import numpy
import pytest

import cupytp
from cupytp import nn, ops
from cupytp.autograd import engine
from cupytp.backend import asnumpy


@pytest.fixture(scope="module", autouse=True)
def runtime():
    cupytp.init()


def full(t):
    return asnumpy(t.full_tensor())


def blocks(recompute=False):
    """Two float64 blocks (seeded) and an input leaf; the loss of x through them."""
    cupytp.manual_seed(0)
    model = nn.ModuleList([nn.DBlock(8, 2, dtype="fp64") for _ in range(2)])
    x = cupytp.randn((2, 5, 8), dtype="fp64", requires_grad=True)
    y = x
    for block in model:
        y = nn.recompute(block, y) if recompute else block(y)
    w = cupytp.randn((8, 3), dtype="fp64", requires_grad=True)   # used twice
    y = y @ w + (y * y) @ w
    return model, x, w, (y * y).sum()


def one():
    return cupytp.ones((), dtype="fp64")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_two_parts_give_what_one_backward_gives(fused, recompute):
    with ops.fusion(fused):
        model, x, w, loss = blocks(recompute)
        loss.backward()
        expected = [full(x.grad), full(w.grad)] + [full(p.grad) for p in model.parameters()]
        model, x, w, loss = blocks(recompute)
        deferred = engine.backward(loss, one(), inputs=[x])
        numpy.testing.assert_array_equal(full(x.grad), expected[0])
        if not recompute:             # a recomputed block runs its whole backward at once
            assert w.grad is None     # the head's products: only in the deferred part
        deferred.run()
    got = [full(x.grad), full(w.grad)] + [full(p.grad) for p in model.parameters()]
    for g, e in zip(got, expected):
        numpy.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("fused", [False, True])
def test_weight_products_run_only_in_the_deferred_part(fused):
    """As chains of ops or as fused sublayers, every weight's gradient product waits: the
    first part computes none of them. A fused sublayer (the MLP: float64 attention runs its
    chain) gives all its parameters, its LayerNorm's too, their gradients in the deferred
    part."""
    with ops.fusion(fused):
        model, x, w, loss = blocks()
        deferred = engine.backward(loss, one(), inputs=[x])
    matrices = [p for name, p in model.named_parameters() if name.endswith("weight")
                and p.ndim >= 2] + [w]
    assert all(p.grad is None for p in matrices)
    if fused:
        mlps = [p for block in model for p in block.mlp.parameters() + block.ln_2.parameters()]
        assert all(p.grad is None for p in mlps)
    assert x.grad is not None
    deferred.run()
    assert all(p.grad is not None for p in matrices)
    with pytest.raises(RuntimeError, match="has run already"):
        deferred.run()


def test_without_inputs_everything_waits_and_a_leaf_root_too():
    model, x, w, loss = blocks()
    deferred = engine.backward(loss, one(), inputs=[])
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    deferred.run()
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())
    leaf = cupytp.randn((3,), dtype="fp64", requires_grad=True)
    later = engine.backward(leaf, cupytp.ones((3,), dtype="fp64"), inputs=[])
    assert leaf.grad is None
    later.run()
    numpy.testing.assert_array_equal(full(leaf.grad), numpy.ones(3))


def test_inputs_must_be_leaves():
    _, x, _, loss = blocks()
    with pytest.raises(ValueError, match="takes leaf tensors"):
        engine.backward(loss, one(), inputs=[x * 2.0])
