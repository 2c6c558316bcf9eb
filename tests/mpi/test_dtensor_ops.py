"""Every op on its supported layouts against the same op on one rank: values and gradients,
1-D and 2-D meshes, uneven sizes, Partial inputs."""
import numpy
import pytest

import cupytp
from cupytp import ops
from cupytp.ops import ShardingError
from cupytp.backend import bfloat16
from cupytp.tensor import Partial, Replicated, Shard
from dense_reference import check_against_dense, full, lay_out, rng_array

R, P = Replicated(), Partial()
S = Shard


def each(mesh, *per_input):
    """Placement tuples on `mesh` for each input from per-mesh-dim options (same on all dims)."""
    return [tuple((p,) * mesh.ndim for p in combo) for combo in zip(*per_input)]


def run_all(fn, arrays, combos, mesh, **kwargs):
    for placements in combos:
        try:
            check_against_dense(fn, arrays, placements, mesh, **kwargs)
        except AssertionError as err:
            raise AssertionError(f"placements {placements}: {err}") from None


BINARY = [ops.add, ops.sub, ops.mul, ops.div]


@pytest.mark.parametrize("op", BINARY, ids=lambda f: f.__name__)
def test_binary_elementwise(mesh, op):
    a, b, row = rng_array((7, 5), 1), rng_array((7, 5), 2) + 3.0, rng_array((5,), 3) + 3.0
    combos = each(mesh, [R, S(0), S(1), P, S(0), R, S(1)], [R, S(0), S(1), R, R, S(1), P])
    run_all(op, [a, b], combos, mesh)
    run_all(op, [a, row], each(mesh, [S(0), S(1), R, P], [R, S(0), S(0), R]), mesh)
    run_all(lambda x: op(x, 2.5), [a], each(mesh, [R, S(1), P]), mesh)
    run_all(lambda x: op(1.5, x), [b], each(mesh, [R, S(0), P]), mesh)


@pytest.mark.parametrize("name", ["neg", "exp", "log", "sqrt", "tanh", "gelu"])
def test_unary_elementwise(mesh, name):
    x = numpy.abs(rng_array((6, 5), 4)) + 0.5
    fn = getattr(ops, name)
    run_all(fn, [x], each(mesh, [R, S(0), S(1), P]), mesh)
    run_all(lambda v: ops.pow(v, 3), [x], each(mesh, [S(1), P]), mesh)


def test_matmul_layouts(mesh):
    x, w, b3 = rng_array((3, 5, 6), 5), rng_array((6, 7), 6), rng_array((3, 6, 4), 7)
    combos = each(mesh,
                  [R, R, S(2), S(2), R, S(0), S(1), P, R],
                  [R, S(1), S(0), R, S(0), R, R, R, P])
    run_all(ops.matmul, [x, w], combos, mesh)
    run_all(ops.matmul, [x, b3], each(mesh, [S(0), R, S(2), R], [S(0), S(0), S(1), S(2)]), mesh)


def test_matmul_without_rule_raises(mesh1d):
    if mesh1d.size() == 1:
        pytest.skip("every layout is replicated on one rank")
    x = lay_out(rng_array((4, 6), 1), mesh1d, (S(0),))
    w = lay_out(rng_array((6, 5), 2), mesh1d, (S(1),))
    with pytest.raises(ShardingError, match=r"einsum.*redistribute"):
        ops.matmul(x, w)


def test_einsum_attention_forms(mesh):
    q, k = rng_array((2, 4, 5, 3), 8), rng_array((2, 4, 6, 3), 9)
    run_all(lambda a, b: ops.einsum("bhtd,bhsd->bhts", a, b), [q, k],
            each(mesh, [S(1), R, S(0), S(3)], [S(1), S(1), R, S(3)]), mesh)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("dim,keepdim", [(None, False), (0, False), (1, True), ((0, 2), False)])
def test_reductions(mesh, reduce, dim, keepdim):
    x = rng_array((5, 7, 3), 10)
    fn = lambda v: getattr(ops, reduce)(v, dim, keepdim)
    options = [R, S(0), S(1), S(2)] + ([P] if reduce != "max" else [])
    combos = each(mesh, options)
    if reduce == "max":   # a max over a sharded dim is Partial(max): no gradient, value only
        for placements in combos:
            sharded_reduced = any(isinstance(p, Shard) and (dim is None or p.dim in
                                  ((dim,) if isinstance(dim, int) else dim))
                                  for p in placements[0])
            check_against_dense(fn, [x], [placements[0]], mesh, grad=not sharded_reduced)
        return
    run_all(fn, [x], combos, mesh)


def test_shape_ops(mesh):
    x = rng_array((4, 6, 5), 11)
    run_all(lambda v: v.reshape(4, 2, 3, 5), [x], each(mesh, [R, S(0), S(2), P]), mesh)
    run_all(lambda v: v.reshape(24, 5), [x], each(mesh, [R, S(2), P]), mesh)
    run_all(lambda v: v.permute(2, 0, 1), [x], each(mesh, [R, S(0), S(1), S(2), P]), mesh)
    run_all(lambda v: v.transpose(0, 1), [x], each(mesh, [S(0), S(2)]), mesh)
    run_all(lambda v: v[1:3, :, 2], [x], each(mesh, [R, S(1), P]), mesh)
    run_all(lambda v: v[..., None, 1], [x], each(mesh, [R, S(0), S(1)]), mesh)
    run_all(lambda v: ops.concat([v, v * 2.0], 1), [x], each(mesh, [R, S(0), S(2), P]), mesh)
    run_all(lambda v: ops.split(v, [2, 4], 1)[1], [x], each(mesh, [R, S(0), S(2)]), mesh)
    run_all(lambda v: ops.stack([v, v], 1), [x], each(mesh, [R, S(0)]), mesh)


def test_reshape_of_uneven_shard_raises(mesh1d):
    if mesh1d.size() == 1:
        pytest.skip("needs shards")
    x = lay_out(rng_array((mesh1d.size() + 1, 2), 1), mesh1d, (S(0),))
    with pytest.raises(ShardingError, match="reshape"):
        x.reshape(-1)


def test_index_into_sharded_dim_raises(mesh1d):
    x = lay_out(rng_array((4, 6), 1), mesh1d, (S(1),))
    with pytest.raises(ShardingError, match="sharded"):
        x[:, 1:3]


def test_softmax_family(mesh):
    x = rng_array((3, 4, 7), 12)
    for fn in (lambda v: ops.softmax(v, -1), lambda v: ops.log_softmax(v, -1),
               lambda v: ops.softmax(v, 0)):
        run_all(fn, [x], each(mesh, [R, S(1), P]), mesh)


def test_layer_norm(mesh):
    x, w, b = rng_array((3, 5, 8), 13), rng_array((8,), 14), rng_array((8,), 15)
    run_all(lambda v, g, h: ops.layer_norm(v, g, h), [x, w, b],
            each(mesh, [R, S(0), S(1), P], [R, R, P, R], [R, P, R, R]), mesh)


def test_embedding(mesh):
    ids = numpy.random.default_rng(16).integers(0, 11, size=(3, 5))
    table = rng_array((11, 6), 17)
    run_all(ops.embedding, [ids, table],
            each(mesh, [R, R, R, S(0), S(1)], [R, S(0), S(1), R, R]), mesh)


def test_take_along_last(mesh):
    x = rng_array((4, 3, 9), 18)
    index = numpy.random.default_rng(19).integers(0, 9, size=(4, 3))
    run_all(ops.take_along_last, [x, index],
            each(mesh, [R, S(2), S(0), P, R], [R, R, R, R, S(1)]), mesh)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(mesh, reduction):
    logits = rng_array((4, 3, 13), 20)
    targets = numpy.random.default_rng(21).integers(0, 13, size=(4, 3))
    targets[1, 2] = targets[3, 0] = -100
    fn = lambda x, t: ops.cross_entropy(x, t, ignore_index=-100, reduction=reduction)
    run_all(fn, [logits, targets], each(mesh, [R, S(2), S(0), P, S(2)], [R, R, S(0), R, R]),
            mesh)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_padded_vocabulary(mesh, reduction):
    """13 columns of which 10 exist, in uneven vocabulary shards (on 4 ranks the last shard is
    all padding): equal to the dense op, and the mean to the float64 formula over the real
    columns, though the padding holds the largest logits."""
    logits = rng_array((4, 3, 13), 27)
    logits[..., 10:] += 6.0
    targets = numpy.random.default_rng(28).integers(0, 10, size=(4, 3))
    targets[0, 1] = -100
    fn = lambda x, t: ops.cross_entropy(x, t, reduction=reduction, vocab_size=10)
    combos = each(mesh, [R, S(2), S(0), P], [R, R, S(0), R])
    run_all(fn, [logits, targets], combos, mesh)
    out = check_against_dense(fn, [logits, targets], combos[1], mesh)
    x = logits[..., :10]
    lse = numpy.log(numpy.exp(x).sum(-1))
    picked = numpy.take_along_axis(x, numpy.clip(targets, 0, None)[..., None], -1)[..., 0]
    losses = (lse - picked) * (targets != -100)
    expected = losses if reduction == "none" else losses.sum() / (targets != -100).sum()
    numpy.testing.assert_allclose(out, expected, rtol=1e-12)


def test_bias_gelu(mesh):
    """Column-parallel x (..., H/tp) with bias Shard(0), batch-sharded x with a Replicated bias,
    Partial x, and Replicated inputs sliced: values and both gradients equal the dense op."""
    x, bias = rng_array((4, 3, 10), 29), rng_array((10,), 30)
    run_all(ops.bias_gelu, [x, bias],
            each(mesh, [R, S(2), S(0), P, S(2), R], [R, S(0), R, R, R, S(0)]), mesh)


def test_bias_residual_add(mesh):
    """A row-parallel output (Partial: reduced first) or a sharded one with a Replicated bias,
    and the residual on the same layouts: values and the three gradients equal the dense op's,
    and on one rank the dense op equals residual + (y + bias) composed of plain ops."""
    y, bias, residual = rng_array((4, 3, 10), 31), rng_array((10,), 32), rng_array((4, 3, 10), 33)
    run_all(ops.bias_residual_add, [y, bias, residual],
            each(mesh, [P, R, S(0), S(2), P, S(1)], [R, R, R, S(0), R, R],
                 [R, R, S(0), S(2), S(0), R]), mesh)
    fused = check_against_dense(ops.bias_residual_add, [y, bias, residual],
                                [(R,) * mesh.ndim] * 3, mesh)
    numpy.testing.assert_allclose(fused, residual + (y + bias), rtol=1e-15)
    dense = cupytp.tensor.factory.local_mesh()
    grads = []
    for fn in (ops.bias_residual_add, lambda a, b, r: r + (a + b)):
        inputs = [lay_out(a, dense, (R,), requires_grad=True) for a in (y, bias, residual)]
        weight = lay_out(rng_array(y.shape, 34), dense, (R,))
        (fn(*inputs) * weight).sum().backward()
        grads.append([full(t.grad) for t in inputs])
    for got, want in zip(*grads):
        numpy.testing.assert_allclose(got, want, rtol=1e-15)


def test_vocab_parallel_cross_entropy_never_gathers(mesh1d, monkeypatch):
    """Two all-reduces (max, then the packed sums) and no all-gather, forward and backward."""
    group = mesh1d.get_process_group(0)
    calls = []
    for name in ("all_gather", "all_reduce", "reduce_scatter"):
        original = getattr(group, name)
        monkeypatch.setattr(group, name, lambda *a, _n=name, _f=original, **k:
                            (calls.append(_n), _f(*a, **k))[1])
    logits = lay_out(rng_array((6, 10), 22), mesh1d, (S(1),), requires_grad=True)
    targets = lay_out(numpy.arange(6) % 10, mesh1d, (R,))
    for vocab_size in (None, 7):
        calls.clear()
        ops.cross_entropy(logits, targets, vocab_size=vocab_size).backward()
        if mesh1d.size() > 1:
            assert calls == ["all_reduce", "all_reduce"], calls


def test_dropout_is_mesh_invariant(mesh):
    x = numpy.abs(rng_array((6, 10), 23)) + 1.0

    def fn(v):
        cupytp.manual_seed(1234)
        return ops.dropout(v, 0.3)
    out = run_all(fn, [x], each(mesh, [R, S(0), S(1), P]), mesh)
    cupytp.manual_seed(1234)
    kept = full(ops.dropout(lay_out(x, mesh, (R,) * mesh.ndim), 0.3)) != 0
    assert 0.5 < kept.mean() < 0.9
    del out


@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_dropout_add_is_mesh_invariant(mesh, with_bias):
    """residual + dropout(y + bias) with y Partial (a row-parallel output: reduced first) or
    sharded, the residual laid out any way: any mesh equals one rank, gradients included; the
    same as the chain of add and dropout ops."""
    y, residual, bias = rng_array((5, 4, 6), 34), rng_array((5, 4, 6), 35), rng_array((6,), 36)

    def fn(y, residual, bias=None):
        cupytp.manual_seed(99)
        return ops.bias_dropout_add(y, bias, residual, 0.4)
    arrays = [y, residual] + ([bias] if with_bias else [])
    combos = each(mesh, [P, R, S(0), S(2), S(1)], [R, S(0), R, S(2), R], [R, R, R, S(0), R])
    run_all(fn, arrays, [c[:len(arrays)] for c in combos], mesh)
    dense = cupytp.local_mesh()
    inputs = [lay_out(a, dense, (R,)) for a in arrays]
    cupytp.manual_seed(99)
    chain = inputs[1] + ops.dropout(inputs[0] + inputs[2] if with_bias else inputs[0], 0.4)
    numpy.testing.assert_allclose(full(fn(*inputs)), full(chain), rtol=1e-14, atol=1e-14)


def test_attention_heads_sharded(mesh):
    q, k, v = (rng_array((2, 4, 5, 3), s) for s in (24, 25, 26))
    run_all(ops.scaled_dot_product_attention, [q, k, v],
            each(mesh, [R, S(1), S(0)], [R, S(1), S(0)], [R, S(1), S(0)]), mesh)


def test_attention_dropout_is_mesh_invariant(mesh):
    """The matmul path (float64) with dropout on the probabilities: any mesh equals one rank."""
    q, k, v = (rng_array((2, 5, 4, 3), s) for s in (27, 28, 29))

    def fn(*x):
        cupytp.manual_seed(77)
        return ops.scaled_dot_product_attention(*x, dropout_p=0.3)
    run_all(fn, [q, k, v], each(mesh, [R, S(1), S(0)], [R, S(1), S(0)], [R, S(1), S(0)]), mesh)


@pytest.mark.parametrize("causal,p", [(True, 0.0), (True, 0.25), (False, 0.25)])
def test_flash_attention_equals_matmul_path(mesh, causal, p):
    """bf16 with head dim 64 takes the flash node (its NumPy twin on CPU): with 5 heads split
    unevenly, the batch split, or Partial inputs, its output and gradients equal the float64
    matmul path on one rank, dropout mask included."""
    arrays = [rng_array((2, 5, 6, 64), s).astype(bfloat16) for s in (30, 31, 32)]
    weight = rng_array((2, 5, 6, 64), 33)

    def run(mesh_, placements, dtype):
        inputs = [lay_out(a.astype(dtype), mesh_, pl, requires_grad=True)
                  for a, pl in zip(arrays, placements)]
        cupytp.manual_seed(5)
        out = ops.scaled_dot_product_attention(*inputs, causal=causal, dropout_p=p)
        (out * lay_out(weight.astype(dtype), mesh_, (R,) * mesh_.ndim)).sum().backward()
        return [full(out)] + [full(x.grad) for x in inputs]

    expected = run(cupytp.local_mesh(), [(R,)] * 3, numpy.float64)
    for placements in each(mesh, [R, S(1), S(0), P], [R, S(1), S(0), R], [S(1), S(1), S(0), R]):
        for got, want in zip(run(mesh, placements, bfloat16), expected):
            got = got.astype(numpy.float64)        # bf16: Partial parts add rounding of their own
            numpy.testing.assert_allclose(got, want, rtol=0, atol=0.06,
                                          err_msg=f"placements {placements}")
            assert numpy.linalg.norm(got - want) < 0.01 * numpy.linalg.norm(want), placements


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_packed_attention_equals_three_part_attention(mesh, p):
    """packed_attention of a (B, T, 3, H, D) bf16 tensor (flash node, packed gradient) equals
    scaled_dot_product_attention of its transposed parts on one rank in float64 (the matmul
    path), output and gradient, with 5 heads split unevenly or the batch split, dropout
    included; float64 takes the composed path and matches it to rounding."""
    packed = rng_array((2, 6, 3, 5, 64), 36)
    weight = rng_array((2, 6, 5, 64), 37)

    def unpacked(qkv):
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        return ops.scaled_dot_product_attention(q, k, v, causal=True, dropout_p=p).transpose(1, 2)

    def run(fn, mesh_, placements, dtype):
        qkv = lay_out(packed.astype(dtype), mesh_, placements, requires_grad=True)
        cupytp.manual_seed(9)
        out = fn(qkv)
        (out * lay_out(weight.astype(dtype), mesh_, (R,) * mesh_.ndim)).sum().backward()
        return [full(out).astype(numpy.float64), full(qkv.grad).astype(numpy.float64)]

    expected = run(unpacked, cupytp.local_mesh(), (R,), numpy.float64)
    packed_attention = lambda qkv: ops.packed_attention(qkv, causal=True, dropout_p=p)
    for (placements,) in each(mesh, [R, S(3), S(0)]):
        for got, want in zip(run(packed_attention, mesh, placements, bfloat16), expected):
            assert numpy.linalg.norm(got - want) < 0.01 * numpy.linalg.norm(want), placements
        for got, want in zip(run(packed_attention, mesh, placements, numpy.float64), expected):
            numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="packed as"):
        ops.packed_attention(lay_out(packed[:, :, :2], mesh, (R,) * mesh.ndim))


def test_attention_rejects_sequence_sharding(mesh1d):
    q = lay_out(rng_array((1, 2, 8, 64), 34).astype(bfloat16), mesh1d, (S(2),))
    with pytest.raises(ShardingError, match="batch \\(0\\) or heads \\(1\\)"):
        ops.scaled_dot_product_attention(q, q, q)


def test_bad_inputs(mesh1d):
    x = lay_out(rng_array((4, 6), 1), mesh1d, (R,))
    with pytest.raises(ValueError, match="placements"):
        x.redistribute((R, R))
    with pytest.raises(ValueError, match="out of range"):
        x.redistribute((S(2),))
    with pytest.raises(ValueError, match="not a placement"):
        x.redistribute(("shard",))
    with pytest.raises(TypeError, match="wrap arrays"):
        x + numpy.ones((4, 6))
    other = cupytp.local_mesh()
    if mesh1d.size() > 1:
        y = lay_out(rng_array((4, 6), 2), other, (R,))
        with pytest.raises(ValueError, match="different meshes"):
            x + y
    with pytest.raises(ValueError, match="out of range"):
        x.sum(3)
