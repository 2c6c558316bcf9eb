"""Each op on one rank: values against NumPy formulas, gradients against central finite
differences (float64)."""
import math

import numpy
import pytest

import cupytp
from cupytp import backend, ops
from cupytp.tensor import Replicated, Shard
from cupytp.autograd import no_grad

rng = numpy.random.default_rng(0)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    cupytp.init()


def dt(array, grad=True):
    return cupytp.from_local(backend.asarray(numpy.asarray(array)), requires_grad=grad)


def value(x):
    return backend.asnumpy(x.full_tensor())


def gradcheck(fn, *arrays, eps=1e-6, tol=1e-6):
    """Analytic gradients of sum(fn(*inputs) * w) against central differences."""
    inputs = [dt(a, grad=a.dtype.kind == "f") for a in arrays]
    out = fn(*inputs)
    w = numpy.random.default_rng(1).standard_normal(out.shape)
    (out * dt(w, grad=False)).sum().backward()

    def loss(values):
        with no_grad():
            return float((value(fn(*[dt(v, grad=False) for v in values])) * w).sum())
    for i, a in enumerate(arrays):
        if a.dtype.kind != "f":
            continue
        numeric = numpy.zeros_like(a)
        for index in numpy.ndindex(a.shape):
            plus, minus = [v.copy() for v in arrays], [v.copy() for v in arrays]
            plus[i][index] += eps
            minus[i][index] -= eps
            numeric[index] = (loss(plus) - loss(minus)) / (2 * eps)
        numpy.testing.assert_allclose(value(inputs[i].grad), numeric, rtol=tol, atol=tol,
                                      err_msg=f"input {i}")
    return value(out)


def r(*shape, positive=False):
    a = rng.standard_normal(shape)
    return numpy.abs(a) + 0.5 if positive else a


def gelu_ref(x):
    return 0.5 * x * (1 + numpy.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("fn,ref,positive", [
    (ops.exp, numpy.exp, False), (ops.log, numpy.log, True), (ops.sqrt, numpy.sqrt, True),
    (ops.tanh, numpy.tanh, False), (ops.neg, numpy.negative, False), (ops.gelu, gelu_ref, False),
    (lambda x: ops.pow(x, 3), lambda x: x ** 3, False),
])
def test_unary(fn, ref, positive):
    x = r(3, 4, positive=positive)
    numpy.testing.assert_allclose(gradcheck(fn, x, tol=1e-5), ref(x), rtol=1e-6)


def test_astype_round_trip_gradient():
    x = dt(r(3, 4))
    y = ops.astype(ops.astype(x, "bf16"), "fp64")
    assert y.dtype == numpy.float64
    numpy.testing.assert_allclose(value(y), value(x), rtol=1e-2)
    (y * 3.0).sum().backward()
    assert x.grad.dtype == numpy.float64
    numpy.testing.assert_array_equal(value(x.grad), numpy.full((3, 4), 3.0))


@pytest.mark.parametrize("fn,ref", [(ops.add, numpy.add), (ops.sub, numpy.subtract),
                                    (ops.mul, numpy.multiply), (ops.div, numpy.divide)])
def test_binary_broadcasting(fn, ref):
    a, b = r(2, 3, 4), r(3, 1, positive=True)
    numpy.testing.assert_allclose(gradcheck(fn, a, b), ref(a, b), rtol=1e-12)


def test_matmul_and_einsum():
    a, b, c = r(2, 3, 4), r(4, 5), r(2, 5, 4)
    numpy.testing.assert_allclose(gradcheck(ops.matmul, a, b), a @ b, rtol=1e-12)
    numpy.testing.assert_allclose(gradcheck(ops.matmul, a, c.transpose(0, 2, 1)),
                                  a @ c.transpose(0, 2, 1), rtol=1e-12)
    out = gradcheck(lambda x, y: ops.einsum("btc,bsc->bts", x, y), a, c)
    numpy.testing.assert_allclose(out, numpy.einsum("btc,bsc->bts", a, c), rtol=1e-12)
    with pytest.raises(ValueError, match="summed"):
        ops.einsum("ab,bc->c", dt(r(2, 3)), dt(r(3, 4)))


@pytest.mark.parametrize("name", ["sum", "mean", "max"])
@pytest.mark.parametrize("dim,keepdim", [(None, False), (1, False), ((0, 2), True)])
def test_reductions(name, dim, keepdim):
    x = r(3, 4, 5)
    out = gradcheck(lambda v: getattr(ops, name)(v, dim, keepdim), x)
    expected = getattr(numpy, {"sum": "sum", "mean": "mean", "max": "max"}[name])(
        x, axis=dim, keepdims=keepdim)
    numpy.testing.assert_allclose(out, expected, rtol=1e-12)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("dim", [(0, 1), 1])
def test_16_bit_sums_add_in_float32(dtype, dim):
    """A sum of 16-bit values adds them in float32 and rounds once (the GPU's column-sum
    kernel and its twin, or a float32 sum): 4096 values near 1 along the leading dimensions (a
    bias gradient, whose sums a 16-bit accumulator stalls at 256), or along the middle one; the
    engine's broadcast sums (the gradient of a bias added to (B, T, C)) alike."""
    if backend.on_gpu and dim == 1:
        pytest.skip("on a GPU a sum over other than leading dimensions is CuPy's")
    x = numpy.abs(r(64, 64, 3)) + 0.5
    low = backend.dtype(dtype)
    expected = x.astype(low).astype(numpy.float64).sum(axis=dim)
    got = value(ops.sum(dt(x.astype(low), grad=False), dim)).astype(numpy.float64)
    numpy.testing.assert_allclose(got, expected, rtol=2 ** -7)
    bias = dt(numpy.zeros(3).astype(low))
    (dt(x.astype(low), grad=False) + bias).sum().backward()
    numpy.testing.assert_allclose(value(bias.grad).astype(numpy.float64), numpy.full(3, 4096.0))


def test_shape_ops():
    x = r(2, 3, 4)
    numpy.testing.assert_allclose(gradcheck(lambda v: v.reshape(6, 4), x), x.reshape(6, 4))
    numpy.testing.assert_allclose(gradcheck(lambda v: v.permute(2, 0, 1), x),
                                  x.transpose(2, 0, 1))
    numpy.testing.assert_allclose(gradcheck(lambda v: v[1, :, 1:3], x), x[1, :, 1:3])
    numpy.testing.assert_allclose(gradcheck(lambda v: ops.concat([v, v * 3.0], 2), x),
                                  numpy.concatenate([x, 3 * x], 2))
    pieces = gradcheck(lambda v: ops.stack(ops.split(v, [1, 2], 1)[:1] * 2, 0), x)
    numpy.testing.assert_allclose(pieces, numpy.stack([x[:, :1], x[:, :1]]))


def test_softmax_log_softmax():
    x = r(3, 5)
    e = numpy.exp(x - x.max(-1, keepdims=True))
    numpy.testing.assert_allclose(gradcheck(lambda v: ops.softmax(v, -1), x),
                                  e / e.sum(-1, keepdims=True), rtol=1e-12)
    numpy.testing.assert_allclose(gradcheck(lambda v: ops.log_softmax(v, -1), x),
                                  numpy.log(e / e.sum(-1, keepdims=True)), rtol=1e-12)


def test_layer_norm():
    x, w, b = r(2, 3, 6), r(6), r(6)
    out = gradcheck(lambda v, g, h: ops.layer_norm(v, g, h, eps=1e-5), x, w, b)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    numpy.testing.assert_allclose(out, (x - mean) / numpy.sqrt(var + 1e-5) * w + b, rtol=1e-10)


def test_layer_norm_on_a_residual_stream_sums_its_gradients_in_one_pass(monkeypatch):
    """x feeds a LayerNorm and a later addition (a pre-LN block): the addition's gradient of x
    joins the LayerNorm's dx inside its backward kernel (no separate sum), and the gradients
    are those of the dense math."""
    from cupytp.launchers import layernorm
    given = []
    backward = layernorm.layer_norm_backward

    def spy(g, x, mean, rstd, weight, dx_dtype=None, add=None, param_grads=False):
        given.append(add is not None)
        return backward(g, x, mean, rstd, weight, dx_dtype, add, param_grads)
    monkeypatch.setattr(layernorm, "layer_norm_backward", spy)

    def block(v, w, b):
        s = v * 2.0                               # the residual stream (not a leaf)
        y = ops.layer_norm(s, w, b, eps=1e-5)
        return s + y * y
    x, w, b = r(2, 3, 6), r(6), r(6)
    out = gradcheck(block, x, w, b)
    s = 2 * x
    mean, var = s.mean(-1, keepdims=True), s.var(-1, keepdims=True)
    y = (s - mean) / numpy.sqrt(var + 1e-5) * w + b
    numpy.testing.assert_allclose(out, s + y * y, rtol=1e-10)
    assert given and all(given)


def test_embedding_and_take():
    ids = numpy.array([[0, 3, 3], [1, 4, 0]])
    table = r(5, 4)
    numpy.testing.assert_allclose(gradcheck(ops.embedding, ids, table), table[ids])
    x = r(2, 3, 5)
    numpy.testing.assert_allclose(gradcheck(ops.take_along_last, x, ids),
                                  numpy.take_along_axis(x, ids[..., None], -1)[..., 0])


@pytest.mark.parametrize("mesh_shape", [None, (1, 1)])
def test_a_tied_tables_lookup_gradient_sums_into_its_other_gradient(monkeypatch, mesh_shape):
    """A table used as the output product's weight and then looked up: the lookup's gradient
    is added into the product's (in place, no gradient of its own), and the sum is that of two
    untied copies; with nothing there yet (the lookup alone), it makes its own. On a (dp, tp)
    mesh of one rank each, the batch split over dp and the table over tp (as GPT-2 lays them
    out), the lookup's Partial gradient over dp is the product's Replicated one: it sums in
    place."""
    from cupytp.launchers import embedding as kernels
    given = []
    backward = kernels.embedding_backward
    monkeypatch.setattr(kernels, "embedding_backward",
                        lambda *a, **k: (given.append(a[4] is not None), backward(*a, **k))[1])
    ids, probe = numpy.array([[0, 3, 3], [1, 4, 0]]), r(2, 3, 5)

    def dt(array, grad=True):
        if mesh_shape is None:
            return cupytp.from_local(backend.asarray(array), requires_grad=grad)
        mesh = cupytp.DeviceMesh(mesh_shape, ("dp", "tp"))
        placements = (Replicated(), Shard(0)) if grad else (Shard(0), Replicated())
        return cupytp.from_local(backend.asarray(array), mesh, placements, requires_grad=grad)

    def loss(lookup, output):
        x = ops.embedding(dt(ids, grad=False), lookup)
        return (ops.einsum("btc,vc->btv", x, output) * dt(probe, grad=False)).sum()
    table = r(5, 4)
    tied = dt(table)
    loss(tied, tied).backward()
    lookup, output = dt(table), dt(table)
    loss(lookup, output).backward()
    numpy.testing.assert_allclose(value(tied.grad), value(lookup.grad) + value(output.grad),
                                  rtol=1e-13, atol=1e-13)
    assert given == [True, False]           # the tied table's, then the untied lookup's own


def test_cross_entropy():
    x = r(4, 7)
    t = numpy.array([1, 6, -100, 0])
    out = gradcheck(lambda v, u: ops.cross_entropy(v, u, ignore_index=-100), x, t)
    lse = numpy.log(numpy.exp(x).sum(-1))
    picked = x[numpy.arange(4), numpy.clip(t, 0, None)]
    numpy.testing.assert_allclose(out, ((lse - picked) * (t != -100)).sum() / 3, rtol=1e-12)


def test_cross_entropy_gradient_written_in_the_forward_is_the_backwards(monkeypatch):
    """The forward writes the logits' gradient for the per-row gradient the last backward
    brought; over steps whose loss is scaled by 1, 1, 0.5, 0.5, 1 (a gradient seen first, then
    again) the logits' gradient is bit for bit the backward computing it, and the backward
    rewrites rows only at the steps where the gradient changed."""
    from cupytp.launchers import cross_entropy as kernels
    from cupytp.ops import functional
    monkeypatch.setattr(functional, "_learned_gradients", {})
    rewritten, backward = [], kernels.cross_entropy_backward
    monkeypatch.setattr(kernels, "cross_entropy_backward", lambda *a, **k: (
        rewritten.append(bool((a[4] != a[8][0]).any())), backward(*a, **k))[1])
    x, t = r(3, 4, 9), numpy.array([[1, 6, -100, 0], [8, 8, 2, -100], [3, 4, 5, 6]])
    valid = (t != -100).sum()
    for factor in (1.0, 1.0, 0.5, 0.5, 1.0):
        logits = dt(x)
        (ops.cross_entropy(logits, dt(t, grad=False)) * factor).backward()
        on = backend.asarray        # the plain kernels of this backend (or their twins)
        m, stats = kernels.cross_entropy_forward(on(x), on(t), 0, 9, -100)
        g = on(numpy.full(t.shape, numpy.float64(factor) / valid))
        want = backward(on(x), m, stats[..., 0].copy(), on(t), g, 0, 9, -100)
        numpy.testing.assert_array_equal(value(logits.grad), backend.asnumpy(want))
    assert rewritten == [True, False, True, False, True]


def cross_entropy_ref(x, t, vocab_size):
    """Mean cross-entropy over the rows whose target is not -100, softmax over the first
    `vocab_size` columns only."""
    x = x[..., :vocab_size].astype(numpy.float64)
    lse = numpy.log(numpy.exp(x).sum(-1))
    picked = numpy.take_along_axis(x, numpy.clip(t, 0, None)[..., None], -1)[..., 0]
    return ((lse - picked) * (t != -100)).sum() / (t != -100).sum()


def test_cross_entropy_padded_vocabulary():
    """Columns at or past vocab_size never count: not in the loss, zero gradient (the finite
    differences see no change), even when they hold the largest logits."""
    x = r(2, 3, 9)
    x[..., 6:] += 5.0
    t = numpy.array([[1, 5, -100], [0, 3, 5]])
    out = gradcheck(lambda v, u: ops.cross_entropy(v, u, vocab_size=6), x, t)
    numpy.testing.assert_allclose(out, cross_entropy_ref(x, t, 6), rtol=1e-12)
    none = value(ops.cross_entropy(dt(x, grad=False), t, reduction="none", vocab_size=6))
    assert none.shape == (2, 3) and none[0, 2] == 0.0


def test_cross_entropy_bf16_logits_give_float32_loss():
    """bf16 logits are read as they are (computed in float32): a float32 loss and bf16
    gradients, within bf16 accuracy of the float64 reference."""
    x = r(4, 11).astype(backend.bfloat16)
    t = numpy.array([3, 9, -100, 0])
    logits = dt(x)
    loss = ops.cross_entropy(logits, t, vocab_size=10)
    assert loss.dtype == numpy.float32
    numpy.testing.assert_allclose(value(loss), cross_entropy_ref(x, t, 10), rtol=1e-6)
    loss.backward()
    assert logits.grad.dtype == backend.bfloat16
    p = numpy.exp(x[:, :10].astype(numpy.float64))
    p /= p.sum(-1, keepdims=True)
    p[numpy.arange(4), numpy.clip(t, 0, None)] -= 1
    expected = numpy.concatenate([p * (t != -100)[:, None] / 3, numpy.zeros((4, 1))], -1)
    numpy.testing.assert_allclose(value(logits.grad).astype(numpy.float64), expected,
                                  rtol=1e-2, atol=1e-3)


def test_cross_entropy_bad_arguments():
    x = dt(r(3, 5), grad=False)
    with pytest.raises(ValueError, match=r"vocab_size 6 must be in \[1, 5\]"):
        ops.cross_entropy(x, numpy.array([0, 1, 2]), vocab_size=6)
    with pytest.raises(TypeError, match="targets must be integers"):
        ops.cross_entropy(x, numpy.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="index shape"):
        ops.cross_entropy(x, numpy.array([0, 1]))
    with pytest.raises(ValueError, match="reduction 'avg'"):
        ops.cross_entropy(x, numpy.array([0, 1, 2]), reduction="avg")
    # A target past the vocabulary (not ignore_index) is caught on the device: a NaN loss.
    assert numpy.isnan(value(ops.cross_entropy(x, numpy.array([0, 4, 2]), vocab_size=4)))


def test_bias_gelu():
    x, b = r(2, 3, 5), r(5)
    out = gradcheck(ops.bias_gelu, x, b)
    numpy.testing.assert_allclose(out, gelu_ref(x + b), rtol=1e-12)
    with pytest.raises(ValueError, match=r"bias must have shape \(5,\)"):
        ops.bias_gelu(dt(x), dt(r(3)))


def test_attention_matches_numpy():
    q, k, v = r(1, 2, 4, 3), r(1, 2, 4, 3), r(1, 2, 4, 3)
    out = gradcheck(ops.scaled_dot_product_attention, q, k, v)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(3)
    scores = numpy.where(numpy.triu(numpy.ones((4, 4), bool), 1), -numpy.inf, scores)
    p = numpy.exp(scores - scores.max(-1, keepdims=True))
    numpy.testing.assert_allclose(out, (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-12)


def test_dropout_mask_and_scale():
    x = numpy.ones((50, 40))
    def fn(v):
        cupytp.manual_seed(3)
        return ops.dropout(v, 0.25)
    out = gradcheck(fn, x[:6, :5])
    out = value(fn(dt(x, grad=False)))
    kept = out != 0
    assert abs(kept.mean() - 0.75) < 0.03
    numpy.testing.assert_allclose(out[kept], 1 / 0.75)


def test_gradient_accumulates_and_graph_is_freed():
    x = dt(r(3))
    y = (x * 2.0).sum()
    y.backward()
    (x * 3.0).sum().backward()
    numpy.testing.assert_allclose(value(x.grad), numpy.full(3, 5.0))
    with pytest.raises(RuntimeError, match="freed"):
        z = x * 2.0
        w = z.sum() + z.sum()
        w.backward()
        w.backward()
    with no_grad():
        assert not (x * 2.0).requires_grad


@pytest.mark.parametrize("case", ["fresh", "twice", "passed_through", "saved", "view",
                                  "whole_view", "whole_view_of_saved"])
def test_leaf_keeps_only_an_unshared_gradient_uncopied(case):
    """A gradient that only the backward pass holds becomes the leaf's .grad as it is; one that
    anything else holds (another input, the incoming gradient, a closure, an array it is a view
    of) is copied, so changing one .grad in place (clipping, accumulation) changes nothing
    else."""
    from cupytp.autograd import engine
    a, b = dt(r(4)), dt(r(4))
    saved = dt(r(4), grad=False)
    made = {}

    def backward(g):
        if case == "fresh":
            ga, gb = g * 2.0, g * 3.0
            made.update(a=id(ga._local), b=id(gb._local))
            return ga, gb
        if case == "twice":
            shared = g * 2.0
            return shared, shared
        if case == "passed_through":
            return g, None
        if case == "saved":
            return saved, None
        if case == "whole_view":        # a reshaped contraction result: its base is fresh
            reshaped = backend.xp.full((2, 2), 3.0).reshape(4)
            made.update(a=id(reshaped))
            return cupytp.from_local(reshaped), None
        if case == "whole_view_of_saved":
            return cupytp.from_local(saved._local.reshape(2, 2).reshape(4)), None
        whole = backend.xp.zeros(8)
        return cupytp.from_local(whole[:4]), None
    out = engine.record(dt(numpy.zeros(4), grad=False), (a, b), backward, "test")
    incoming = dt(numpy.ones(4), grad=False)
    out.backward(incoming)
    if case == "fresh":
        assert id(a.grad._local) == made["a"] and id(b.grad._local) == made["b"]
        return
    if case == "whole_view":
        assert id(a.grad._local) == made["a"]
        return
    if case == "twice":
        assert a.grad._local is not b.grad._local
        numpy.testing.assert_array_equal(value(a.grad), value(b.grad))
    held = {"passed_through": incoming, "saved": saved, "whole_view_of_saved": saved}.get(case)
    before = None if held is None else value(held).copy()
    a.grad._local *= 0.0
    assert value(a.grad).sum() == 0
    if case == "twice":
        numpy.testing.assert_array_equal(value(b.grad), numpy.full(4, 2.0))
    if held is not None:
        numpy.testing.assert_array_equal(value(held), before)
    if case == "view":
        assert a.grad._local.base is None


def test_autocast_bf16_contractions():
    """Inside autocast("bf16") contractions run in bfloat16 (fp32 accumulation) and the fp32
    leaves still get fp32 gradients, within bf16 accuracy of the fp32 result."""
    a, w = r(2, 5, 16), r(16, 8)
    results = {}
    for dtype in (None, "bf16"):
        x, y = dt(a.astype(numpy.float32)), dt(w.astype(numpy.float32))
        with ops.autocast(dtype):
            out = ops.einsum("btc,cd->btd", x, y)
        assert out.dtype == (backend.bfloat16 if dtype else numpy.float32)
        ops.astype(out, "fp32").sum().backward()
        assert x.grad.dtype == y.grad.dtype == numpy.float32
        results[dtype] = [value(out).astype(numpy.float64), value(x.grad), value(y.grad)]
    for got, want in zip(results["bf16"], results[None]):
        numpy.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("spec", ["btc,btd->cd", "btc,vc->btv", "btv,btc->vc", "btjd,cjd->btc",
                                  "btc,btjd->cjd", "tbc,btd->dc", "bc,cd->bd"])
def test_bf16_contractions_read_operands_in_place(spec):
    """bfloat16 einsums run as one matmul of (views of) the operands, whatever axes they
    contract and whatever order the output wants: the values are the float32 products of the
    bf16 inputs (a transposition mistake would be far off)."""
    sizes = dict(b=2, t=3, c=4, d=5, v=6, j=3)
    letters = spec.split("->")[0].split(",")
    a, b = (r(*[sizes[x] for x in s]).astype(backend.bfloat16) for s in letters)
    out = ops.einsum(spec, dt(a, grad=False), dt(b, grad=False))
    expected = numpy.einsum(spec, a.astype(numpy.float64), b.astype(numpy.float64))
    assert out.dtype == backend.bfloat16 and out.shape == expected.shape
    numpy.testing.assert_allclose(value(out).astype(numpy.float64), expected, rtol=1e-2,
                                  atol=1e-2)


def test_tape_keeps_only_what_backward_closures_save():
    """Intermediates that no backward needs die with the forward pass (the tape holds nodes,
    not tensors): a matmul's output before its bias, a cast's input, a LayerNorm's input; the
    gradients are still those of the whole chain."""
    import gc
    import weakref
    a, w, bias = r(2, 3, 4), r(4, 5), r(5)
    x, wt, b = dt(a), dt(w), dt(bias)
    product = ops.matmul(x, wt)                   # einsum saves x and w, not its output
    shifted = product + b                         # add saves nothing
    widened = ops.astype(shifted, "fp32")         # astype saves nothing
    normed = ops.layer_norm(widened, None, None)  # saves xhat and rstd, not its input
    refs = [weakref.ref(t) for t in (product, shifted, widened)]
    del product, shifted, widened
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
    weights = r(2, 3, 5)
    (ops.astype(normed, "fp64") * dt(weights, grad=False)).sum().backward()
    h = a @ w + bias
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    xhat = (h - mu) / numpy.sqrt(var + 1e-5)
    d = weights.astype(numpy.float32).astype(numpy.float64)
    dh = (d - d.mean(-1, keepdims=True) - xhat * (d * xhat).mean(-1, keepdims=True)) / \
        numpy.sqrt(var + 1e-5)
    numpy.testing.assert_allclose(value(b.grad), dh.sum((0, 1)), rtol=1e-4, atol=1e-5)
    numpy.testing.assert_allclose(value(wt.grad), numpy.einsum("btc,btd->cd", a, dh),
                                  rtol=1e-4, atol=1e-5)


def test_autocast_layer_norm_gives_the_autocast_dtype():
    """Inside autocast("bf16") a float32 layer_norm returns bf16 (the float32 result rounded
    once) and its input still gets a float32 gradient, that of the float32 op on the bf16
    incoming gradient."""
    a, w, bias, g = r(2, 3, 8), r(8), r(8), r(2, 3, 8)
    results = {}
    for dtype in (None, "bf16"):
        x, wt, b = (dt(v.astype(numpy.float32)) for v in (a, w, bias))
        with ops.autocast(dtype):
            out = ops.layer_norm(x, wt, b)
        assert out.dtype == (backend.bfloat16 if dtype else numpy.float32)
        weight = g.astype(backend.bfloat16).astype(numpy.float32)
        (ops.astype(out, "fp32") * dt(weight, grad=False)).sum().backward()
        assert x.grad.dtype == wt.grad.dtype == numpy.float32
        results[dtype] = [value(out).astype(numpy.float64), value(x.grad), value(wt.grad),
                          value(b.grad)]
    exact = results[None][0].astype(numpy.float32).astype(backend.bfloat16)
    assert (results["bf16"][0] == exact.astype(numpy.float64)).all()
    for got, want in zip(results["bf16"][1:], results[None][1:]):
        numpy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
