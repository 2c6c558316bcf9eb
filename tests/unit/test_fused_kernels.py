"""The fused kernels of the GPT-2 step (vocab-parallel cross-entropy, bias + GeLU, embedding
backward, column sums, bias add, converting row copies): each NumPy twin against an independent float64 reference (row-by-row formulas,
finite differences, a Python loop), and on a GPU each kernel against its twin."""
import math

import numpy
import pytest

from cupytp.backend import asnumpy, bfloat16, xp
from cupytp.launchers import compute_dtype, dtype_suffix
from cupytp.launchers.bias_add import applies as bias_add_applies, bias_add, bias_add_numpy
from cupytp.launchers.bias_add import bias_residual_add, bias_residual_add_numpy, residual_applies
from cupytp.launchers.cast import applies as cast_applies, cast_rows, cast_rows_numpy, converted
from cupytp.launchers.column_sum import MAX_ROW_BLOCKS as SUM_ROW_BLOCKS, ROW_LANES, ROWS_PER_THREAD
from cupytp.launchers.column_sum import column_sum, column_sum_and_cast
from cupytp.launchers.column_sum import column_sum_numpy
from cupytp.launchers.cross_entropy import cross_entropy_backward, cross_entropy_backward_numpy
from cupytp.launchers.dropout import dropout_backward_numpy
from cupytp.launchers.cross_entropy import cross_entropy_forward, cross_entropy_forward_numpy
from cupytp.launchers.cross_entropy import (
    cross_entropy_forward_grad, cross_entropy_forward_grad_numpy, forward_grad_fits)
from cupytp.launchers.embedding import (
    embedding_backward, embedding_backward_numpy, embedding_forward, embedding_forward_numpy)
from cupytp.launchers.gelu import MAX_ROW_BLOCKS, THREADS, bias_gelu, bias_gelu_backward
from cupytp.launchers.gelu import gelu_backward
from cupytp.launchers.gelu import bias_gelu_backward_numpy, bias_gelu_numpy
from test_kernels import (
    F16, F32, F64, assert_close, gelu_reference, poisoned_allocations, random, requires_gpu)

IGNORE = -100


# ---- cross-entropy twin -------------------------------------------------------------------------

def cross_entropy_reference(logits, targets, vocab_size):
    """Per-row loss and d loss / d logits in float64, one row at a time: softmax over the first
    `vocab_size` columns; ignored rows give 0 and no gradient."""
    flat = logits.astype(F64).reshape(-1, logits.shape[-1])
    loss, grad = numpy.zeros(len(flat)), numpy.zeros(flat.shape)
    for i, (row, t) in enumerate(zip(flat, targets.ravel())):
        if t == IGNORE:
            continue
        x = row[:vocab_size]
        lse = x.max() + math.log(numpy.exp(x - x.max()).sum())
        loss[i] = lse - x[t]
        grad[i, :vocab_size] = numpy.exp(x - lse)
        grad[i, t] -= 1.0
    return loss.reshape(targets.shape), grad.reshape(logits.shape)


def ce_inputs(shape, vocab_size, dtype, seed=0, scale=3.0):
    """Logits (scaled so rows are peaked), targets over [0, vocab_size) with two ignored rows and
    the last real column as one target."""
    rng = numpy.random.default_rng(seed)
    logits = (scale * rng.standard_normal(shape)).astype(dtype)
    targets = rng.integers(0, vocab_size, size=shape[:-1]).astype(numpy.int64)
    flat = targets.reshape(-1)
    flat[0], flat[-1] = IGNORE, vocab_size - 1
    if flat.size > 3:
        flat[2] = IGNORE
    return logits, targets


def combine_shards(logits, targets, vocab_size, shards, forward=cross_entropy_forward):
    """Run `forward` on each column shard of the logits and combine the shards' results as the
    op does across ranks; returns (loss, global row max, global row sum, column splits)."""
    splits = numpy.array_split(numpy.arange(logits.shape[-1]), shards)
    results = [forward(numpy.ascontiguousarray(logits[..., cols]), targets,
                       int(cols[0]) if cols.size else 0, vocab_size, IGNORE)
               for cols in splits]
    m = numpy.max([r[0] for r in results], axis=0)                       # max all-reduce
    total = sum(r[1][..., 0] * numpy.exp(r[0] - m) for r in results)     # sum all-reduce
    picked = sum(r[1][..., 1] for r in results)
    loss = numpy.where(targets != IGNORE, numpy.log(total) + m - picked, 0)
    return loss, m, total, splits


@pytest.mark.parametrize("dtype", [F64, F32, bfloat16], ids=dtype_suffix)
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_cross_entropy_twin_shards_match_float64_reference(dtype, shards):
    """13 columns of which 10 exist, in uneven shards (the last of 4 is all padding): the loss
    and the gradient match the row-by-row softmax in float64, padding columns get zeros."""
    vocab_size = 10
    logits, targets = ce_inputs((2, 3, 13), vocab_size, dtype)
    logits[..., vocab_size:] = 50.0   # padding that would win every row if it counted
    expected_loss, expected_grad = cross_entropy_reference(logits, targets, vocab_size)
    loss, m, total, splits = combine_shards(logits, targets, vocab_size, shards)
    tolerance = 1e-12 if dtype == F64 else 2e-5
    numpy.testing.assert_allclose(loss, expected_loss, rtol=tolerance, atol=tolerance)
    g = random(targets.shape, compute_dtype(dtype), seed=3)
    dx = numpy.concatenate([cross_entropy_backward(
        numpy.ascontiguousarray(logits[..., cols]), m, total, targets, g,
        int(cols[0]) if cols.size else 0, vocab_size, IGNORE) for cols in splits], axis=-1)
    assert dx.dtype == dtype and dx.shape == logits.shape
    assert_close(dx, expected_grad * g[..., None], dtype)
    assert not dx[..., vocab_size:].any()


def test_cross_entropy_twin_row_statistics():
    """Per shard: the max and the sum of exponentials over its existing columns, the target's
    logit only where this shard holds it; an all-padding shard gives (-inf, 0, 0)."""
    logits = random((5, 6), F64, seed=1)     # global columns 6..11, of which 6..8 exist
    targets = numpy.array([IGNORE, 6, 2, 8, 7])
    m, stats = cross_entropy_forward_numpy(logits, targets, 6, 9, IGNORE)
    x = logits[:, :3]
    numpy.testing.assert_allclose(m, x.max(-1), rtol=0)
    numpy.testing.assert_allclose(stats[:, 0], numpy.exp(x - x.max(-1, keepdims=True)).sum(-1),
                                  rtol=1e-14)
    numpy.testing.assert_array_equal(stats[:, 1], [0, logits[1, 0], 0, logits[3, 2],
                                                   logits[4, 1]])
    m, stats = cross_entropy_forward_numpy(logits, targets, 12, 9, IGNORE)
    assert numpy.isneginf(m).all() and not stats.any()
    m, stats = cross_entropy_forward_numpy(logits[:, :0], targets, 9, 9, IGNORE)
    assert m.shape == (5,) and numpy.isneginf(m).all() and not stats.any()


def test_cross_entropy_twin_bad_targets_give_nan():
    logits, targets = ce_inputs((4, 7), 5, F32)
    targets[1], targets[2] = 5, -1          # a padding column and a negative non-ignored id
    _, stats = cross_entropy_forward(logits, targets, 0, 5, IGNORE)
    assert numpy.isnan(stats[1:3, 1]).all() and not numpy.isnan(stats[[0, 3]]).any()


def test_cross_entropy_rejects_bad_arrays():
    logits, targets = ce_inputs((4, 7), 7, F32)
    with pytest.raises(ValueError, match="targets must be int64 of shape"):
        cross_entropy_forward(logits, targets.astype(numpy.int32), 0, 7, IGNORE)
    with pytest.raises(ValueError, match="targets must be int64 of shape"):
        cross_entropy_forward(logits, targets[:3], 0, 7, IGNORE)
    with pytest.raises(ValueError, match="not C-contiguous"):
        cross_entropy_forward(numpy.asfortranarray(logits), targets, 0, 7, IGNORE)
    m, stats = cross_entropy_forward(logits, targets, 0, 7, IGNORE)
    with pytest.raises(ValueError, match="row_sum must be float32 of shape"):
        cross_entropy_backward(logits, m, stats[:, 0].astype(F64), targets, m, 0, 7, IGNORE)


@pytest.mark.parametrize("dtype", [F64, F32, bfloat16], ids=dtype_suffix)
def test_cross_entropy_twin_writes_the_gradient_the_backward_keeps(dtype):
    """forward_grad: the forward's statistics and the backward's dlogits for the learned per-row
    gradient, bit for bit; the backward given what it expected leaves the rows whose gradient is
    that one as written (poison there stays) and writes the others, bit for bit the plain
    backward's; row 0's new gradient is learned, unless 0 or not finite."""
    logits, targets = ce_inputs((2, 3, 9), 8, dtype, seed=4)
    compute = compute_dtype(dtype)
    learned = numpy.array([0.25], compute)
    m, stats, dx, expected = cross_entropy_forward_grad_numpy(logits, targets, 0, 8, IGNORE,
                                                              learned)
    m_plain, stats_plain = cross_entropy_forward_numpy(logits, targets, 0, 8, IGNORE)
    numpy.testing.assert_array_equal(m, m_plain)
    numpy.testing.assert_array_equal(stats, stats_plain)
    row_sum = numpy.ascontiguousarray(stats[..., 0])

    def plain(g):
        return cross_entropy_backward_numpy(logits, m, row_sum, targets, g, 0, 8, IGNORE)
    same = numpy.full(targets.shape, 0.25, compute)
    numpy.testing.assert_array_equal(bits(dx), bits(plain(same)))
    assert expected[0] == 0.25 and expected is not learned
    g = same.copy()
    g[1, 2] = 0.5                                       # one row brings another gradient
    poisoned = numpy.full(dx.shape, numpy.nan, dtype)
    out = cross_entropy_backward_numpy(logits, m, row_sum, targets, g, 0, 8, IGNORE, expected,
                                       learned, poisoned)
    assert out is poisoned and learned[0] == 0.25       # row 0's gradient is the expected one
    numpy.testing.assert_array_equal(bits(out[1, 2]), bits(plain(g)[1, 2]))
    assert numpy.isnan(numpy.delete(out.reshape(6, 9), 5, axis=0).astype(F64)).all()
    for first, kept in ((0.125, 0.125), (0.0, 0.125), (numpy.inf, 0.125)):
        g = numpy.full(targets.shape, first, compute)
        with numpy.errstate(invalid="ignore"):          # inf times 0 in the target's column
            out = cross_entropy_backward_numpy(logits, m, row_sum, targets, g, 0, 8, IGNORE,
                                               expected, learned, dx.copy())
            numpy.testing.assert_array_equal(bits(out), bits(plain(g)))
        assert learned[0] == kept


def bits(a):
    """The bits of a float array (equal NaNs of any dtype compare equal)."""
    return numpy.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


# ---- column sums twin ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F64, F32, bfloat16, F16], ids=dtype_suffix)
def test_column_sum_numpy_matches_row_loop(dtype):
    x = random((3, 4, 9), dtype, seed=20)
    h = random((3, 4, 9), compute_dtype(dtype), seed=21)
    rows = x.reshape(-1, 9).astype(F64)
    plain, product = numpy.zeros(9), numpy.zeros(9)
    for i, row in enumerate(rows):
        plain += row
        product += row * h.reshape(-1, 9)[i].astype(F64)
    assert column_sum(x).dtype == dtype
    assert_close(column_sum(x), plain, dtype)
    assert column_sum(x, h, dtype=F32 if dtype != F64 else F64).dtype == compute_dtype(dtype)
    assert_close(column_sum(x, h, dtype=compute_dtype(dtype)), product, compute_dtype(dtype))


@pytest.mark.parametrize("cast", [bfloat16, F16], ids=dtype_suffix)
def test_column_sum_and_cast_numpy_sums_and_rounds(cast):
    x = random((3, 4, 9), F32, seed=24)
    sums, copy = column_sum_and_cast(x, cast, F64)
    assert sums.dtype == F64 and copy.dtype == cast and copy.shape == x.shape
    assert_close(sums, x.reshape(-1, 9).astype(F64).sum(axis=0), F32)
    numpy.testing.assert_array_equal(copy, x.astype(cast))
    with pytest.raises(ValueError, match="float32 x to bf16 or fp16"):
        column_sum_and_cast(x.astype(F64), cast)


def test_column_sum_and_cast_numpy_drops_out_as_the_dropout_backward():
    """With a dropout mask: the copy is dropout_backward's bit for bit, the sums its column sums;
    a mask of another size is refused."""
    x = random((6, 16), F32, seed=26)
    mask = numpy.random.default_rng(3).integers(0, 256, size=12, dtype=numpy.uint8)
    sums, copy = column_sum_and_cast(x, bfloat16, F32, mask, 0.3)
    want = dropout_backward_numpy(x, mask, 0.3, bfloat16)
    numpy.testing.assert_array_equal(bits(copy), bits(want))
    dropped = dropout_backward_numpy(x, mask, 0.3, F32)
    assert_close(sums, dropped.astype(F64).sum(axis=0), F32)
    assert (copy.astype(F32) == 0).sum() > 0
    with pytest.raises(ValueError, match="the mask must hold 12 bytes"):
        column_sum_and_cast(x, bfloat16, F32, mask[:11], 0.3)


def test_column_sum_rejects_bad_inputs():
    x = random((4, 3), bfloat16)
    with pytest.raises(ValueError, match="compute dtype"):
        column_sum(x, random((4, 3), bfloat16))
    with pytest.raises(ValueError, match="shape"):
        column_sum(x, random((4, 2), F32))
    with pytest.raises(ValueError, match="dtype"):
        column_sum(numpy.ones((2, 2), numpy.int32))


# ---- bias add twin ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F64, F32, bfloat16, F16], ids=dtype_suffix)
def test_bias_add_numpy_equals_broadcast_sum(dtype):
    x, bias = random((3, 4, 9), dtype, seed=24), random((9,), dtype, seed=25)
    y = bias_add(x, bias)
    assert y.dtype == dtype and y.shape == x.shape
    expected = (x.astype(F64) + bias.astype(F64)).astype(dtype)   # one rounding of the sum
    assert (y.astype(F64) == expected.astype(F64)).all()


def test_bias_add_applies_only_to_a_row_bias():
    x = random((4, 3), F32)
    assert bias_add_applies(x, random((3,), F32))
    assert not bias_add_applies(x, random((4,), F32))             # not the last dimension
    assert not bias_add_applies(x, random((3,), F64))             # other dtype: promotion
    assert not bias_add_applies(x.T, random((4,), F32))           # not contiguous
    with pytest.raises(ValueError, match="bias of shape"):
        bias_add(x, random((2,), F32))


@pytest.mark.parametrize("dtype", [F64, F32, bfloat16, F16], ids=dtype_suffix)
def test_bias_residual_add_numpy_equals_float64_sum(dtype):
    compute = compute_dtype(dtype)
    x, bias = random((3, 4, 9), dtype, seed=28), random((9,), compute, seed=29)
    residual = random((3, 4, 9), compute, seed=30)
    out = bias_residual_add(x, bias, residual)
    assert out.dtype == compute and out.shape == x.shape
    expected = residual.astype(F64) + (x.astype(F64) + bias.astype(F64))
    assert_close(out, expected, compute)


def test_bias_residual_add_applies_to_a_compute_dtype_bias_and_residual():
    x = random((4, 3), bfloat16)
    bias, residual = random((3,), F32), random((4, 3), F32)
    assert residual_applies(x, bias, residual)
    assert not residual_applies(x, bias.astype(bfloat16), residual)          # 16-bit bias
    assert not residual_applies(x, bias, residual.astype(bfloat16))          # 16-bit residual
    assert not residual_applies(x, bias, random((2, 4, 3), F32))             # broadcast residual
    assert not residual_applies(x, random((4,), F32), residual)              # not the last dim
    assert not residual_applies(random((3, 4), bfloat16).T, bias, residual)  # not contiguous
    with pytest.raises(ValueError, match="residual of x's shape"):
        bias_residual_add(x, bias, residual.T)


# ---- converting row copies twin ----------------------------------------------------------------

CAST_PAIRS = [(F32, bfloat16), (bfloat16, F32), (F32, F16), (F16, F32), (F32, F32),
              (bfloat16, bfloat16), (F64, F64)]


@pytest.mark.parametrize("src_dtype,dst_dtype", CAST_PAIRS,
                         ids=lambda d: dtype_suffix(d))
def test_cast_rows_numpy_writes_and_adds_into_a_block_of_columns(src_dtype, dst_dtype):
    src = random((3, 5), src_dtype, seed=30)
    wide = random((3, 11), dst_dtype, seed=31)
    before = wide.copy()
    cast_rows(wide[:, 4:9], src)
    assert (wide[:, 4:9] == src.astype(dst_dtype)).all()
    assert (wide[:, :4] == before[:, :4]).all() and (wide[:, 9:] == before[:, 9:]).all()
    cast_rows(wide[:, 4:9], src, add=True)
    exact = 2 * src.astype(F64)                   # x + x: exact in the sum's dtype
    assert (wide[:, 4:9].astype(F64) == exact.astype(dst_dtype).astype(F64)).all()


@pytest.mark.parametrize("src_dtype,dst_dtype", CAST_PAIRS + [(F64, F32), (F32, F64)],
                         ids=lambda d: dtype_suffix(d))
def test_converted_is_astype_bit_for_bit(src_dtype, dst_dtype):
    """On either backend, the kernel's pairs and the rest alike, for strided arrays, and for
    contiguous ones with and without vector alignment."""
    host = random((7, 130), src_dtype, seed=34, scale=100.0)
    flat = xp.asarray(random((1028,), src_dtype, seed=35, scale=100.0))
    for array in (xp.asarray(host), xp.asarray(host)[:, ::3], flat[:1024].reshape(8, 128),
                  flat[1:1025]):
        got = converted(array, dst_dtype)
        assert got.dtype == dst_dtype and got.shape == array.shape
        assert (asnumpy(got).astype(F64) == asnumpy(array.astype(dst_dtype)).astype(F64)).all()


def test_cast_rows_applies_to_rows_of_one_shape():
    a = random((4, 6), F32)
    assert cast_applies(a[:, :3], random((4, 3), bfloat16))
    assert cast_applies(a[0], random((6,), bfloat16))
    assert not cast_applies(a[:, ::2], random((4, 3), bfloat16))    # strided columns
    assert not cast_applies(a, random((6, 4), bfloat16))             # another shape
    assert not cast_applies(a, random((4, 6), F64))                  # no kernel for the pair
    with pytest.raises(ValueError, match="cast_rows takes"):
        cast_rows(a, random((4, 6), F64))


# ---- bias + GeLU twin ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F64, F32, bfloat16, F16], ids=dtype_suffix)
def test_bias_gelu_numpy_matches_float64_math(dtype):
    x = random((3, 4, 9), dtype, scale=3.0)
    bias = random((9,), F32, seed=1)
    y = bias_gelu(x, bias)
    assert y.dtype == dtype and y.shape == x.shape
    expected = gelu_reference(x.astype(F64) + bias.astype(compute_dtype(dtype)).astype(F64))
    assert_close(y, expected, dtype)


def test_bias_gelu_backward_numpy_matches_finite_differences():
    x, bias, dy = random((2, 5, 7), F64, seed=2, scale=3.0), random((7,), F64, 3), \
        random((2, 5, 7), F64, 4)
    h = 1e-6
    slope = (gelu_reference(x + bias + h) - gelu_reference(x + bias - h)) / (2 * h)
    dx, dbias = bias_gelu_backward(x, bias, dy)
    numpy.testing.assert_allclose(dx, dy * slope, rtol=1e-7, atol=1e-9)
    numpy.testing.assert_allclose(dbias, (dy * slope).sum(axis=(0, 1)), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("dtype", [F64, bfloat16], ids=dtype_suffix)
def test_gelu_backward_with_sums_matches_finite_differences(dtype):
    """Without a bias: the plain GeLU's gradient, and its column sums over every leading
    dimension summed before rounding (float32 for bf16)."""
    x, dy = random((2, 5, 7), dtype, seed=2, scale=3.0), random((2, 5, 7), dtype, 4)
    x64, dy64 = x.astype(F64), dy.astype(F64)
    slope = (gelu_reference(x64 + 1e-6) - gelu_reference(x64 - 1e-6)) / 2e-6
    dx, sums = gelu_backward(x, dy, sums=True)
    assert dx.dtype == dtype and sums.dtype == compute_dtype(dtype) and sums.shape == (7,)
    tolerance = 1e-7 if dtype == F64 else 1e-5          # a difference quotient's error
    want = dy64 * slope                  # float32 math: near-zero slopes within 2^-8 of the top
    atol = 1e-9 if dtype == F64 else 2 ** -8 * abs(want).max()
    numpy.testing.assert_allclose(dx.astype(F64), want,
                                  rtol=tolerance if dtype == F64 else 2 ** -8, atol=atol)
    numpy.testing.assert_allclose(sums, (dy64 * slope).sum(axis=(0, 1)), rtol=tolerance,
                                  atol=tolerance)
    numpy.testing.assert_array_equal(dx, gelu_backward(x, dy))


def test_bias_gelu_backward_sums_in_the_compute_dtype():
    """bf16 x and dy: dx rounds to bf16, the bias gradient is the float32 sum of the unrounded
    products (not a sum of the rounded dx)."""
    x, dy = random((64, 5), bfloat16, seed=5, scale=3.0), random((64, 5), bfloat16, seed=6)
    bias = random((5,), F32, seed=7)
    dx, dbias = bias_gelu_backward_numpy(x, bias, dy)
    assert dx.dtype == bfloat16 and dbias.dtype == F32
    exact = dy.astype(F64) * (gelu_reference(x.astype(F64) + bias + 1e-6)
                              - gelu_reference(x.astype(F64) + bias - 1e-6)) / 2e-6
    numpy.testing.assert_allclose(dbias, exact.sum(0), rtol=1e-5, atol=1e-5)


def test_bias_gelu_rejects_bad_inputs():
    x = random((4, 6), F32)
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        bias_gelu_numpy(x, random((4,), F32))
    with pytest.raises(ValueError, match="not C-contiguous"):
        bias_gelu(x, random((6, 2), F32)[:, 0])
    with pytest.raises(ValueError, match="dtype"):
        bias_gelu_backward(x, random((6,), F32), x.astype(F64))


# ---- embedding backward twin --------------------------------------------------------------------

def embedding_grad_reference(ids, g, rows):
    """grad[id] += g[k] for every k with id in [0, rows), one Python row at a time, float64."""
    grad = numpy.zeros((rows, g.shape[-1]))
    for k, i in enumerate(ids.ravel().tolist()):
        if 0 <= i < rows:
            grad[i] += g.reshape(-1, g.shape[-1])[k].astype(F64)
    return grad


@pytest.mark.parametrize("dtype", [F64, F32, bfloat16], ids=dtype_suffix)
def test_embedding_backward_numpy_matches_loop(dtype):
    ids = numpy.array([[0, 3, 3, -2], [5, 1, 3, 9]], dtype=numpy.int64)   # repeats, out of range
    g = random((2, 4, 6), dtype, seed=8)
    grad = embedding_backward(ids, g, 6)
    assert grad.dtype == dtype and grad.shape == (6, 6)
    assert_close(grad, embedding_grad_reference(ids, g, 6), dtype)
    with pytest.raises(ValueError, match="ids must be int64 of shape"):
        embedding_backward_numpy(ids.astype(numpy.int32), g, 6)
    # a part of a vocab-parallel table: rows [4, 10), the rest elsewhere
    assert_close(embedding_backward(ids, g, 6, offset=4),
                 embedding_grad_reference(ids - 4, g, 6), dtype)
    # added into a given gradient of the compute dtype (a tied table's), which is returned
    base = random((6, 6), compute_dtype(dtype), seed=9)
    into = base.copy()
    assert embedding_backward(ids, g, 6, into=into) is into
    assert_close(into, base.astype(F64) + embedding_grad_reference(ids, g, 6), dtype)
    with pytest.raises(ValueError, match="contiguous .* of shape \\(6, 6\\)"):
        embedding_backward(ids, g, 6, into=base[:5])


@pytest.mark.parametrize("dtype", [F64, F32, bfloat16], ids=dtype_suffix)
def test_embedding_forward_numpy_takes_rows_and_zeros_outside(dtype):
    ids = numpy.array([[0, 3, 3, -2], [5, 1, 3, 9]], dtype=numpy.int64)
    weight = random((6, 5), dtype, seed=9)
    for offset in (0, 2):
        out = embedding_forward(ids, weight, offset)
        assert out.dtype == dtype and out.shape == (2, 4, 5)
        for k, i in numpy.ndenumerate(ids):
            row = i - offset
            want = weight[row] if 0 <= row < 6 else numpy.zeros(5, dtype)
            numpy.testing.assert_array_equal(out[k], want)
    with pytest.raises(ValueError, match="ids must be int64"):
        embedding_forward_numpy(ids.astype(numpy.int32), weight)


# ---- GPU: each kernel against its twin ----------------------------------------------------------

CE_CASES = [  # (shape, offset, vocab_size): a whole vocabulary, a padded last shard, all padding;
    # the columns a multiple of 16 bytes (the vector form: 1000, 8256, 16400; past 4 vectors of
    # 256 threads in 8256 and 16400, whose existing columns end inside a vector) or not (1, 300
    # but for fp32 and fp64, 4099: one element at a time)
    ((3, 1), 0, 1), ((4, 1000), 0, 1000), ((2, 3, 4099), 4099, 8100), ((5, 300), 600, 550),
    ((6, 0), 10, 20), ((2, 3, 8256), 0, 8250), ((4, 16400), 16400, 32797)]


def ce_kernel_targets(rng, shape, offset, vocab_size):
    """Targets for a shard of `shape` at `offset`: a third of them on the shard, some outside
    [0, vocab_size) (NaN rows), every fourth ignored."""
    targets = rng.integers(0, vocab_size, size=shape[:-1]).astype(numpy.int64)
    flat = targets.reshape(-1)
    existing = min(max(vocab_size - offset, 0), shape[-1])
    if existing:
        flat[1::3] = offset + rng.integers(0, existing, size=flat[1::3].shape)
    flat[2::6], flat[5::6] = vocab_size, -3
    flat[::4] = IGNORE
    return targets


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("shape, offset, vocab_size", CE_CASES)
@pytest.mark.parametrize("start", [0, 1], ids=["aligned", "unaligned"])
def test_cross_entropy_kernels_match_twin(dtype, shape, offset, vocab_size, start):
    """Forward (max, sum, target logit; NaN for targets out of range) and backward against the
    twin; unaligned logits are a view one element into its buffer (the element-at-a-time form
    for every shape)."""
    rng = numpy.random.default_rng(9)
    logits = (3 * rng.standard_normal(shape)).astype(dtype)
    targets = ce_kernel_targets(rng, shape, offset, vocab_size)
    device = _at_offset(logits, start)
    compute = compute_dtype(dtype)
    with poisoned_allocations():
        m, stats = cross_entropy_forward(device, xp.asarray(targets), offset, vocab_size, IGNORE)
    m_twin, stats_twin = cross_entropy_forward_numpy(logits, targets, offset, vocab_size, IGNORE)
    assert m.dtype == compute and stats.dtype == compute and stats.shape == shape[:-1] + (2,)
    assert_close(m, m_twin, compute)
    assert_close(stats, stats_twin, compute)
    out_of_range = (targets != IGNORE) & ((targets < 0) | (targets >= vocab_size))
    assert numpy.array_equal(numpy.isnan(asnumpy(stats)[..., 1]), out_of_range)
    g = rng.standard_normal(shape[:-1]).astype(compute)
    row_sum = numpy.where(stats_twin[..., 0] > 0, stats_twin[..., 0], 1).astype(compute)
    args = (m_twin, row_sum, targets, g)
    with poisoned_allocations():
        dx = cross_entropy_backward(device, *map(xp.asarray, args), offset, vocab_size, IGNORE)
    assert dx.dtype == dtype and dx.shape == shape
    assert_close(dx, cross_entropy_backward_numpy(logits, *args, offset, vocab_size, IGNORE),
                 dtype)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("shape,vocab_size,start", [
    ((4, 7, 64), 64, 0), ((3, 50304), 50257, 0), ((5, 1000), 1000, 1), ((2, 130), 129, 0)])
def test_cross_entropy_forward_grad_kernel_is_the_backward_bit_for_bit(dtype, shape, vocab_size,
                                                                       start):
    """forward_grad on the GPU: the forward kernel's statistics and the backward kernel's
    dlogits for the learned gradient, bit for bit (vector and element-at-a-time forms); the
    backward given what it expected keeps those rows (poison stays) and writes the others as the
    plain backward does; row 0's gradient is learned. The twin agrees to the kernels' accuracy.
    A row must fit a block's shared memory: GPT-2's 50304 bf16 columns do, Llama 3's 128256 not."""
    assert forward_grad_fits(xp.empty((1, 50304), bfloat16))
    assert not forward_grad_fits(xp.empty((1, 128256), bfloat16))
    rng = numpy.random.default_rng(7)
    logits = (3 * rng.standard_normal(shape)).astype(dtype)
    targets = ce_kernel_targets(rng, shape, 0, vocab_size)
    targets[targets >= vocab_size] = 0
    targets[targets < 0] = IGNORE
    device, ids = _at_offset(logits, start), xp.asarray(targets)
    compute = compute_dtype(dtype)
    learned = xp.asarray(numpy.array([0.375], compute))
    if not forward_grad_fits(device):           # 50304 doubles
        with pytest.raises(ValueError, match="more than a block's shared memory"):
            cross_entropy_forward_grad(device, ids, 0, vocab_size, IGNORE, learned)
        return
    with poisoned_allocations():
        m, stats, dx, expected = cross_entropy_forward_grad(device, ids, 0, vocab_size, IGNORE,
                                                            learned)
        m_plain, stats_plain = cross_entropy_forward(device, ids, 0, vocab_size, IGNORE)
    numpy.testing.assert_array_equal(bits(asnumpy(m)), bits(asnumpy(m_plain)))
    numpy.testing.assert_array_equal(bits(asnumpy(stats)), bits(asnumpy(stats_plain)))
    row_sum = xp.ascontiguousarray(stats[..., 0])

    def plain(g):
        return asnumpy(cross_entropy_backward(device, m, row_sum, ids, g, 0, vocab_size, IGNORE))
    g = xp.full(targets.shape, 0.375, compute)
    numpy.testing.assert_array_equal(bits(asnumpy(dx)), bits(plain(g)))
    assert float(expected[0]) == 0.375
    twin = cross_entropy_forward_grad_numpy(logits, targets, 0, vocab_size, IGNORE,
                                            numpy.array([0.375], compute))
    assert_close(dx, twin[2], dtype)
    g.reshape(-1)[-1] = 0.5                     # the last row brings another gradient
    poisoned = xp.full(shape, numpy.nan, dtype)
    out = cross_entropy_backward(device, m, row_sum, ids, g, 0, vocab_size, IGNORE, expected,
                                 learned, poisoned)
    assert out is poisoned and float(learned[0]) == 0.375
    got = asnumpy(out).reshape(-1, shape[-1])
    numpy.testing.assert_array_equal(bits(got[-1]), bits(plain(g).reshape(-1, shape[-1])[-1]))
    assert numpy.isnan(got[:-1].astype(F64)).all()
    g[...] = 0.125                              # every row: row 0's gradient is learned
    out = cross_entropy_backward(device, m, row_sum, ids, g, 0, vocab_size, IGNORE, expected,
                                 learned, dx.copy())
    numpy.testing.assert_array_equal(bits(asnumpy(out)), bits(plain(g)))
    assert float(learned[0]) == 0.125


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("shards", [1, 3])
def test_cross_entropy_kernels_match_float64_reference(dtype, shards):
    """The kernels' loss and gradient over 8256 columns of which 8250 exist, whole or in 3
    shards (the last ending inside a vector), against the row-by-row float64 softmax: the loss
    within 1e-6 relative in float32 (2^x by the special-function unit), 1e-12 in float64. The
    logits are spread little, so each of the 8250 terms moves the loss by about 1e-4."""
    vocab_size = 8250
    logits, targets = ce_inputs((2, 3, 8256), vocab_size, dtype, seed=5, scale=1.0)
    logits[..., vocab_size:] = 50.0   # padding that would win every row if it counted
    expected_loss, expected_grad = cross_entropy_reference(logits, targets, vocab_size)

    def forward(shard, targets, *window):      # the kernel's row statistics, in float64
        return tuple(asnumpy(r).astype(F64) for r in cross_entropy_forward(
            xp.asarray(shard), xp.asarray(targets), *window))
    loss, m, total, splits = combine_shards(logits, targets, vocab_size, shards, forward)
    tolerance = 1e-12 if dtype == F64 else 1e-6
    numpy.testing.assert_allclose(loss, expected_loss, rtol=tolerance, atol=tolerance)
    compute = compute_dtype(dtype)
    g = random(targets.shape, compute, seed=3)
    row = [xp.asarray(m.astype(compute)), xp.asarray(total.astype(compute)),
           xp.asarray(targets), xp.asarray(g)]
    dx = numpy.concatenate([asnumpy(cross_entropy_backward(
        xp.asarray(numpy.ascontiguousarray(logits[..., cols])), *row, int(cols[0]), vocab_size,
        IGNORE)) for cols in splits], axis=-1)
    # relative to each element: the kernel's error, plus the rounding of a 16-bit dx (fp16's
    # subnormals below 2^-14 by an absolute 2^-25)
    rtol, atol = {F64: (4e-12, 0), F32: (4e-6, 0), bfloat16: (2 ** -8, 0),
                  F16: (2 ** -10, 2 ** -24)}[dtype]
    numpy.testing.assert_allclose(dx.astype(F64), expected_grad * g[..., None], rtol=rtol,
                                  atol=atol)
    assert not dx[..., vocab_size:].any()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("shape", [(1,), (3, 1), (5, 7, 33), (70, 1030), (9, 3, 4096),
                                   (THREADS * MAX_ROW_BLOCKS + 5, 3)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_bias_gelu_kernels_match_twin(dtype, shape, offset):
    """Vector and scalar paths, several row lanes per block and more rows than one pass."""
    x = random(shape, dtype, seed=10, scale=3.0)
    dy = random(shape, dtype, seed=11)
    bias = random(shape[-1:], compute_dtype(dtype), seed=12)
    with poisoned_allocations():
        y = bias_gelu(_at_offset(x, offset), xp.asarray(bias))
        dx, dbias = bias_gelu_backward(_at_offset(x, offset), xp.asarray(bias),
                                       _at_offset(dy, offset))
    dx_twin, dbias_twin = bias_gelu_backward_numpy(x, bias, dy)
    assert y.dtype == dtype and dx.dtype == dtype and dbias.dtype == compute_dtype(dtype)
    assert_close(y, bias_gelu_numpy(x, bias), dtype)
    assert_close(dx, dx_twin, dtype)
    scale = max(1.0, float(numpy.abs(dbias_twin).max()))   # a sum over many rows
    assert_close(asnumpy(dbias) / scale, dbias_twin / scale, compute_dtype(dtype))
    with poisoned_allocations():                            # no bias: gelu(x)'s, with sums
        dx, sums = gelu_backward(_at_offset(x, offset), _at_offset(dy, offset), sums=True)
    dx_twin, sums_twin = bias_gelu_backward_numpy(x, None, dy)
    assert dx.dtype == dtype and sums.dtype == compute_dtype(dtype)
    assert_close(dx, dx_twin, dtype)
    scale = max(1.0, float(numpy.abs(sums_twin).max()))
    assert_close(asnumpy(sums) / scale, sums_twin / scale, compute_dtype(dtype))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (5, 7, 33), (8, 1024, 768), (9, 2048),
                                   (ROW_LANES * ROWS_PER_THREAD * SUM_ROW_BLOCKS + 3, 65),
                                   (0, 4)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_column_sum_kernel_matches_twin(dtype, shape, offset):
    """Vector and scalar loads, and more rows than one pass of the grid covers."""
    x = random(shape, dtype, seed=22)
    h = random(shape, compute_dtype(dtype), seed=23)
    with poisoned_allocations():
        plain = column_sum(_at_offset(x, offset))
        product = column_sum(_at_offset(x, offset), _at_offset(h, offset),
                             dtype=F32 if dtype != F64 else F64)
        again = column_sum(_at_offset(x, offset))
    assert plain.dtype == dtype and product.dtype == compute_dtype(dtype)
    assert (asnumpy(again) == asnumpy(plain)).all()          # deterministic
    rows = max(1, x.size // shape[-1])
    for actual, expected, kind in ((plain, column_sum_numpy(x), dtype),
                                   (product, column_sum_numpy(x, h, compute_dtype(dtype)),
                                    compute_dtype(dtype))):
        scale = max(1.0, float(numpy.sqrt(rows)))            # a sum over many rows
        assert_close(asnumpy(actual).astype(F64) / scale,
                     numpy.asarray(expected).astype(F64) / scale, kind)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("cast", [bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("shape", [(3, 1), (5, 7, 33), (8, 1024, 768),
                                   (ROW_LANES * ROWS_PER_THREAD * SUM_ROW_BLOCKS + 3, 64)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_column_sum_and_cast_kernel_matches_twin(cast, shape, offset):
    """The sums as column_sum's kernel gives them, the copy rounded as the twin rounds, bit for
    bit (vector and scalar loads, more rows than one pass covers)."""
    x = random(shape, F32, seed=25)
    with poisoned_allocations():
        sums, copy = column_sum_and_cast(_at_offset(x, offset), cast)
    numpy.testing.assert_array_equal(asnumpy(sums), asnumpy(column_sum(_at_offset(x, offset))))
    numpy.testing.assert_array_equal(asnumpy(copy).astype(F32), x.astype(cast).astype(F32))
    twin, _ = column_sum_and_cast(x, cast)
    scale = max(1.0, float(numpy.sqrt(max(1, x.size // shape[-1]))))
    assert_close(asnumpy(sums).astype(F64) / scale, twin.astype(F64) / scale, F32)
    # with a dropout mask: the copy the dropout backward's, bit for bit
    mask = numpy.random.default_rng(4).integers(0, 256, size=-(-x.size // 8), dtype=numpy.uint8)
    with poisoned_allocations():
        sums, copy = column_sum_and_cast(_at_offset(x, offset), cast, F32, xp.asarray(mask),
                                         0.1)
    numpy.testing.assert_array_equal(bits(asnumpy(copy)),
                                     bits(dropout_backward_numpy(x, mask, 0.1, cast)))
    twin, _ = column_sum_and_cast(x, cast, F32, mask, 0.1)
    assert_close(asnumpy(sums).astype(F64) / scale, twin.astype(F64) / scale, F32)


def bias_row_cases(test):
    """The bias kernels' GPU cases: dtypes, shapes (vector and scalar paths) and an offset of one
    element that leaves no row start aligned."""
    for mark in reversed((pytest.mark.gpu, requires_gpu,
                          pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16],
                                                  ids=dtype_suffix),
                          pytest.mark.parametrize("shape", [(1, 1), (5, 7, 33), (8, 1024, 2304)]),
                          pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"]))):
        test = mark(test)
    return test


@bias_row_cases
def test_bias_add_kernel_matches_twin_and_cupy(dtype, shape, offset):
    x, bias = random(shape, dtype, seed=26), random(shape[-1:], dtype, seed=27)
    with poisoned_allocations():
        y = bias_add(_at_offset(x, offset), xp.asarray(bias))
    assert (asnumpy(y).astype(F64) == bias_add_numpy(x, bias).astype(F64)).all()
    assert (y == xp.asarray(x) + xp.asarray(bias)).all()          # bit-identical to CuPy's


@bias_row_cases
def test_bias_residual_add_kernel_matches_twin(dtype, shape, offset):
    compute = compute_dtype(dtype)
    x, bias = random(shape, dtype, seed=28), random(shape[-1:], compute, seed=29)
    residual = random(shape, compute, seed=30)
    with poisoned_allocations():
        out = bias_residual_add(_at_offset(x, offset), xp.asarray(bias),
                                _at_offset(residual, offset))
    assert out.dtype == compute
    twin = bias_residual_add_numpy(x, bias, residual)
    assert (asnumpy(out).astype(F64) == twin.astype(F64)).all()


def _at_offset(host, offset):
    """A C-contiguous device copy of `host` starting `offset` elements into its buffer."""
    flat = xp.empty(host.size + offset, host.dtype)
    view = flat[offset:].reshape(host.shape)
    view[...] = xp.asarray(host)
    return view


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("src_dtype,dst_dtype", CAST_PAIRS, ids=lambda d: dtype_suffix(d))
@pytest.mark.parametrize("shape,columns", [((1, 1), (0, 1)), ((3, 1001), (2, 1003)),
                                           ((2, 4096), (4096, 8192)), ((5000,), None)])
def test_cast_rows_kernel_matches_twin(src_dtype, dst_dtype, shape, columns):
    """Vector and scalar paths (aligned and unaligned row starts), writing and adding, into a
    block of columns of a wider array whose other columns stay untouched."""
    src = random(shape, src_dtype, seed=32, scale=3.0)
    if columns is None:
        host_dst = random(shape, dst_dtype, seed=33)
        view = lambda a: a
    else:
        host_dst = random((shape[0], columns[1] + 3), dst_dtype, seed=33)
        view = lambda a: a[:, columns[0]:columns[1]]
    for add in (False, True):
        expected = host_dst.copy()
        cast_rows_numpy(view(expected), src, add)
        device = xp.asarray(host_dst)
        with poisoned_allocations():
            cast_rows(view(device), xp.asarray(src), add)
        assert (asnumpy(device).astype(F64) == expected.astype(F64)).all()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
def test_embedding_forward_kernel_matches_twin(dtype):
    rng = numpy.random.default_rng(14)
    ids = rng.integers(-3, 60, size=(4, 257)).astype(numpy.int64)
    weight = rng.standard_normal((37, 768)).astype(dtype)
    for offset in (0, 10):
        with poisoned_allocations():
            out = embedding_forward(xp.asarray(ids), xp.asarray(weight), offset)
        numpy.testing.assert_array_equal(asnumpy(out), embedding_forward_numpy(ids, weight,
                                                                               offset))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
def test_embedding_backward_kernel_matches_twin(dtype):
    rng = numpy.random.default_rng(13)
    ids = rng.integers(-3, 40, size=(4, 257)).astype(numpy.int64)   # repeats, out of range
    ids[0, :100] = 7                                               # one heavily repeated id
    g = rng.standard_normal((4, 257, 768)).astype(dtype)
    with poisoned_allocations():
        grad = embedding_backward(xp.asarray(ids), xp.asarray(g), 37)
    assert grad.dtype == dtype and grad.shape == (37, 768)
    twin = embedding_backward_numpy(ids, g, 37)
    assert_close(grad, twin, dtype)
    # Small integers: every order of the atomic additions gives the exact sum.
    integers = rng.integers(-3, 4, size=g.shape).astype(dtype)
    for offset in (0, 5):
        numpy.testing.assert_array_equal(
            asnumpy(embedding_backward(xp.asarray(ids), xp.asarray(integers), 37,
                                       offset)).astype(F64),
            embedding_backward_numpy(ids, integers, 37, offset).astype(F64))
    base = integers[0, :37].astype(compute_dtype(dtype))
    into = xp.asarray(base)
    embedding_backward(xp.asarray(ids), xp.asarray(integers), 37, into=into)
    numpy.testing.assert_array_equal(asnumpy(into), embedding_backward_numpy(ids, integers, 37,
                                                                             into=base.copy()))
