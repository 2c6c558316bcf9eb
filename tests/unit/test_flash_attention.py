"""Flash attention: the NumPy twin against float64 formulas (forward) and finite differences
(backward), its dropout mask against `ops.dropout`'s, and on a GPU the kernels against the twin
(strided inputs, tails, head dims 64 and 128, causal or not, dropout, poisoned outputs), on
Hopper through both of the kernels' product paths (wgmma and mma.sync)."""
import math

import numpy
import pytest

import cupytp
from cupytp import ops
from cupytp.backend import asnumpy, bfloat16, on_gpu, xp
from cupytp.launchers import cudnn_attention, flash_attention
from cupytp.launchers.flash_attention import (
    AttentionDropout, attention_backward, attention_backward_numpy, attention_forward,
    attention_forward_numpy, dropout_keep, keep_threshold, kept_bits)
from cupytp.tensor import Generator, Replicated, from_local, local_mesh
from test_kernels import F16, F64, poisoned_allocations, requires_gpu


@pytest.fixture(scope="module", autouse=True)
def runtime():
    cupytp.init()


def qkv(b, h, t, s, d, dtype=bfloat16, seed=0):
    rng = numpy.random.default_rng(seed)
    return (rng.standard_normal((b, h, n, d)).astype(dtype) for n in (t, s, s))


def host_dropout(p, heads, seed=11, offset=5, head_offset=0, batch_offset=0):
    """An AttentionDropout whose counters start at `offset` (base a backend 0-d zero)."""
    base = xp.zeros((), dtype=xp.uint64)
    return AttentionDropout(p, seed, base, offset, heads, batch_offset, head_offset)


def reference(q, k, v, causal, scale, keep=None, p=0.0):
    """float64 (o, lse) by the textbook formula; `keep` a boolean mask of kept probabilities."""
    q, k, v = (a.astype(F64) for a in (q, k, v))
    scores = numpy.einsum("bhtd,bhsd->bhts", q, k) * scale
    t, s = scores.shape[-2:]
    o = numpy.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = numpy.full(q.shape[:-1], -numpy.inf)
    for index in numpy.ndindex(q.shape[:-1]):
        visible = numpy.arange(s) <= index[-1] + s - t if causal else numpy.ones(s, bool)
        if not visible.any():
            continue
        row = scores[index][visible]
        lse[index] = row.max() + math.log(numpy.exp(row - row.max()).sum())
        probs = numpy.where(visible, numpy.exp(scores[index] - lse[index]), 0.0)
        if keep is not None:
            probs = probs * keep[index] / (1 - p)
        o[index] = probs @ v[index[:-1]]
    return o, lse


CASES = [(2, 3, 5, 7, True), (1, 2, 7, 5, True), (2, 1, 6, 6, False), (1, 1, 1, 9, True)]


def _rebuild_kernels():
    flash_attention._wgmma.cache_clear()
    flash_attention._kernel.cache_clear()
    flash_attention._plans.clear()


@pytest.fixture(params=["wgmma", "mma.sync"])
def products(request, monkeypatch):
    """The flash kernels built for one product path: Hopper's warpgroup products (compute
    capability 9.0 only) or mma.sync (CUPYTP_FLASH_WGMMA=0)."""
    monkeypatch.setenv("CUPYTP_FLASH_WGMMA", "1" if request.param == "wgmma" else "0")
    _rebuild_kernels()
    try:
        if flash_attention._wgmma() != (request.param == "wgmma"):
            pytest.skip("the wgmma path needs a compute capability 9.0 GPU")
        yield request.param
    finally:
        monkeypatch.undo()
        _rebuild_kernels()


@pytest.mark.parametrize("b,h,t,s,causal", CASES)
@pytest.mark.parametrize("p", [0.0, 0.4])
def test_flash_twin_forward_matches_float64(b, h, t, s, causal, p):
    q, k, v = qkv(b, h, t, s, 64)
    dropout = host_dropout(p, h) if p else None
    o, lse = attention_forward_numpy(q, k, v, causal, 0.125, dropout)
    assert o.dtype == bfloat16 and o.shape == (b, h, t, 64) and lse.dtype == numpy.float32
    assert o.transpose(0, 2, 1, 3).flags.c_contiguous
    keep = dropout_keep(dropout, (b, h, t, s)) if p else None
    o_ref, lse_ref = reference(q, k, v, causal, 0.125, keep, p)
    numpy.testing.assert_allclose(o.astype(F64), o_ref, rtol=1e-2, atol=1e-2)
    numpy.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)
    if t > s and causal:                       # queries that see no key: zeros, lse = -inf
        assert not o[:, :, 0].astype(F64).any() and numpy.isneginf(lse[:, :, 0]).all()


@pytest.mark.parametrize("causal,p", [(True, 0.0), (False, 0.0), (True, 0.3)])
def test_flash_twin_backward_matches_finite_differences(causal, p):
    b, h, t, s, d = 1, 2, 3, 4, 64
    q, k, v = qkv(b, h, t, s, d, seed=1)
    g = numpy.random.default_rng(2).standard_normal((b, h, t, d)).astype(bfloat16)
    dropout = host_dropout(p, h) if p else None
    keep = dropout_keep(dropout, (b, h, t, s)) if p else None
    o, lse = attention_forward_numpy(q, k, v, causal, 0.125, dropout)
    grads = attention_backward_numpy(q, k, v, o, lse, g, causal, 0.125, dropout)
    inputs = [a.astype(F64) for a in (q, k, v)]

    def loss(arrays):
        return (reference(*arrays, causal, 0.125, keep, p)[0] * g.astype(F64)).sum()

    eps = 1e-4
    for which, grad in enumerate(grads):
        assert grad.dtype == bfloat16 and grad.shape == inputs[which].shape
        numeric = numpy.zeros(inputs[which].shape)
        for index in numpy.ndindex(numeric.shape):
            plus, minus = [a.copy() for a in inputs], [a.copy() for a in inputs]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric[index] = (loss(plus) - loss(minus)) / (2 * eps)
        scale = numpy.abs(numeric).max()
        numpy.testing.assert_allclose(grad.astype(F64), numeric, rtol=0, atol=2e-2 * scale,
                                      err_msg=f"gradient of input {which}")


def test_flash_dropout_mask_is_ops_dropout_mask():
    """The twin's mask (all heads, then a block of heads at an offset) is ops.dropout's mask of
    the (B, H, T, S) probabilities drawn from the same generator state."""
    shape = (2, 4, 5, 6)
    mesh = local_mesh()
    probs = from_local(xp.ones(shape), mesh, (Replicated(),), shape=shape)
    kept = asnumpy(ops.dropout(probs, 0.3, generator=Generator(7))._local) != 0
    seed, base, add = Generator(7).philox_args(shape)
    whole = AttentionDropout(0.3, seed, base, add, heads=4)
    numpy.testing.assert_array_equal(dropout_keep(whole, shape), kept)
    block = whole._replace(head_offset=1, batch_offset=1)
    numpy.testing.assert_array_equal(dropout_keep(block, (1, 2, 5, 6)), kept[1:, 1:3])
    assert 0.5 < kept.mean() < 0.9


def position_maps(col_start):
    """Query and key positions of a block of a 96-token sequence (two runs each, as a context-
    parallel rank's zigzag chunks): keys from `col_start` (a multiple of 8 or not)."""
    rows = numpy.concatenate([numpy.arange(0, 24), numpy.arange(72, 96)])
    cols = numpy.concatenate([numpy.arange(col_start, col_start + 24), numpy.arange(64, 80)])
    return rows.astype(numpy.int64), cols.astype(numpy.int64)


@pytest.mark.parametrize("col_start", [8, 12])
def test_flash_dropout_of_a_block_is_the_whole_sequence_mask_at_its_positions(col_start):
    """A block given its query and key positions in a longer sequence draws the mask the whole
    sequence's attention draws there."""
    rows, cols = position_maps(col_start)
    whole = host_dropout(0.4, 5, head_offset=1, batch_offset=1)
    kept = dropout_keep(whole, (2, 3, 96, 96))
    block = whole._replace(rows=xp.asarray(rows), cols=xp.asarray(cols), t_global=96,
                           s_global=96)
    numpy.testing.assert_array_equal(dropout_keep(block, (2, 3, 48, 40)),
                                     kept[:, :, rows][:, :, :, cols])


@pytest.mark.parametrize("p", [0.1, 0.3, 1 / 3, 0.5, 2.0 ** -40, 0.999])
def test_flash_keep_threshold_is_exact(p):
    draws = numpy.arange(2 ** 16, dtype=numpy.uint64)      # every 16-bit half
    threshold = keep_threshold(p)
    numpy.testing.assert_array_equal(draws >= numpy.uint64(threshold),
                                     draws.astype(F64) / 2.0 ** 16 >= p)


def test_flash_bad_inputs_are_clear_errors():
    q, k, v = qkv(1, 2, 3, 3, 64)
    with pytest.raises(ValueError, match="D in"):
        attention_forward(q[..., :32], k[..., :32], v[..., :32], True, 0.125)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        attention_forward(q.astype(numpy.float32), k, v, True, 0.125)
    with pytest.raises(ValueError, match="v must be"):
        attention_forward(q, k, v[:, :1], True, 0.125)
    long = numpy.broadcast_to(q[:, :, :1], (1, 2, 65535 * 64 + 1, 64))   # no memory of its own
    with pytest.raises(ValueError, match="split the sequence"):
        attention_forward(long, long, long, True, 0.125)
    o, lse = attention_forward(q, k, v, True, 0.125)
    assert lse.flags.c_contiguous
    with pytest.raises(ValueError, match="lse must be a float32"):
        attention_backward(q, k, v, o, lse.astype(F64), o, True, 0.125)
    with pytest.raises(ValueError, match="lse must be a float32"):
        attention_backward(q, k, v, o, lse[:, :1], o, True, 0.125)
    tensors = [from_local(xp.asarray(a), local_mesh(), (Replicated(),), shape=a.shape)
               for a in (q, k, v)]
    with pytest.raises(ValueError, match="dropout probability"):
        ops.scaled_dot_product_attention(*tensors, dropout_p=1.0)


@pytest.mark.parametrize("d,t", [(64, 70), (128, 33)])
def test_flash_attention_op_matches_matmul_path(d, t):
    """The op on GPT-2's q, k, v (strided views of one (B, T, 3, H, D) tensor), its output
    transposed and reshaped to (B, T, C) as DAttention does: the bf16 flash node (the kernels on
    GPU, the twin on CPU) against the float64 matmul path, dropout included."""
    b, h = 2, 3
    packed = numpy.random.default_rng(d).standard_normal((b, t, 3, h, d)).astype(bfloat16)
    weight = numpy.random.default_rng(1).standard_normal((b, t, h * d))
    replicated = (Replicated(),)

    def run(dtype):
        x = from_local(xp.asarray(packed.astype(dtype)), local_mesh(), replicated,
                       shape=packed.shape, requires_grad=True)
        q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))         # (B, H, T, D)
        cupytp.manual_seed(3)
        y = ops.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
        y = y.transpose(1, 2).reshape(b, t, h * d)                       # (B, T, C)
        w = from_local(xp.asarray(weight.astype(dtype)), local_mesh(), replicated,
                       shape=weight.shape)
        (y * w).sum().backward()
        return asnumpy(y._local).astype(F64), asnumpy(x.grad._local).astype(F64)

    for got, want in zip(run(bfloat16), run(F64)):
        assert numpy.linalg.norm(got - want) < 1e-2 * numpy.linalg.norm(want)


def test_attention_under_autocast_runs_in_its_dtype(monkeypatch):
    """fp32 q, k, v inside autocast("bf16") take the flash node in bf16, as the training step
    does; CUPYTP_ATTENTION=matmul materializes the scores instead, with the same result."""
    arrays = [a.astype(numpy.float32) for a in qkv(1, 2, 5, 5, 64, seed=5)]

    def run():
        inputs = [from_local(xp.asarray(a), local_mesh(), (Replicated(),), shape=a.shape,
                             requires_grad=True) for a in arrays]
        with ops.autocast("bf16"):
            out = ops.scaled_dot_product_attention(*inputs)
        op = out._node.name
        out.sum().backward()
        return out, op, [asnumpy(x.grad._local).astype(F64) for x in inputs]

    out, op, grads = run()
    assert out.dtype == bfloat16 and op == "scaled_dot_product_attention"
    monkeypatch.setenv("CUPYTP_ATTENTION", "matmul")
    reference, op, reference_grads = run()
    assert op == "einsum"
    numpy.testing.assert_allclose(asnumpy(out._local).astype(F64),
                                  asnumpy(reference._local).astype(F64), atol=2e-2)
    for got, want in zip(grads, reference_grads):
        assert got.dtype == F64 and numpy.abs(got - want).max() < 3e-2


# ---- GPU: kernels against the twin --------------------------------------------------------------
def strided_qkv(b, h, t, d, dtype, seed):
    """q, k, v as (B, H, T, D) views of one (B, T, 3, H, D) array, as GPT-2 builds them."""
    qkv_ = (numpy.random.default_rng(seed).standard_normal((b, t, 3, h, d))).astype(dtype)
    device = xp.asarray(qkv_)
    return ([qkv_[:, :, i].transpose(0, 2, 1, 3) for i in range(3)],
            [device[:, :, i].transpose(0, 2, 1, 3) for i in range(3)])


def relative_error(got, want):
    got, want = asnumpy(got).astype(F64), numpy.asarray(want).astype(F64)
    assert numpy.isfinite(got).all(), "non-finite values (an unwritten element?)"
    return numpy.linalg.norm(got - want) / max(numpy.linalg.norm(want), 1e-30)


GPU_CASES = [  # b, h, t, d, causal, p, dtype
    (2, 3, 64, 64, True, 0.0, bfloat16), (1, 2, 100, 64, True, 0.0, bfloat16),
    (2, 2, 200, 128, True, 0.0, bfloat16), (1, 3, 77, 128, False, 0.0, bfloat16),
    (1, 2, 130, 64, False, 0.0, F16), (2, 2, 97, 64, True, 0.2, bfloat16),
    (1, 2, 65, 128, True, 0.3, F16), (1, 1, 1, 64, True, 0.0, bfloat16),
]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("b,h,t,d,causal,p,dtype", GPU_CASES)
def test_flash_kernels_match_twin(b, h, t, d, causal, p, dtype, products):
    host, device = strided_qkv(b, h, t, d, dtype, seed=t + d)
    g = numpy.random.default_rng(9).standard_normal((b, h, t, d)).astype(dtype)
    dropout = host_dropout(p, h + 2, head_offset=1) if p else None
    with poisoned_allocations():
        o, lse = attention_forward(*device, causal, d ** -0.5, dropout)
    o_twin, lse_twin = attention_forward_numpy(*host, causal, d ** -0.5, dropout)
    assert relative_error(o, o_twin) < 1e-2
    numpy.testing.assert_allclose(asnumpy(lse), lse_twin, rtol=1e-4, atol=1e-4)
    lse_strided = xp.ascontiguousarray(lse.transpose(2, 1, 0)).transpose(2, 1, 0)   # any strides
    with poisoned_allocations():
        grads = attention_backward(*device, o, lse_strided, xp.asarray(g), causal, d ** -0.5,
                                   dropout)
    twin = attention_backward_numpy(*host, asnumpy(o), asnumpy(lse), g, causal, d ** -0.5,
                                    dropout)
    for name, got, want in zip("qkv", grads, twin):
        assert relative_error(got, want) < 2e-2, f"d{name}"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t_less", [0, 4])          # S a multiple of 8, and not
@pytest.mark.parametrize("offset", [2 ** 33, 2 ** 33 - 4])      # counters from a multiple of 8
@pytest.mark.parametrize("kept", [False, True])     # the backward draws again / reads the bits
def test_flash_kernel_dropout_mask_is_bit_exact(d, t_less, offset, kept, products):
    """With v the identity, o = the dropped probabilities, and with do the identity, dv = their
    transpose: zero exactly where the twin drops, in the forward and in the backward (eight keys
    to a Philox draw, shared across lanes, and a draw per probability). Kept bits: the forward
    stores the twin's bits of every visible score where eight keys share a draw."""
    b, h, t = 2, 3, d - t_less
    q, k, _ = qkv(b, h, t, t, d, seed=4)
    eye = numpy.broadcast_to(numpy.eye(t, d), (b, h, t, d)).astype(bfloat16)
    dropout = host_dropout(0.5, 7, seed=123456789123, offset=offset, head_offset=2,
                           batch_offset=1)
    device = [xp.asarray(a) for a in (q, k, eye)]
    if kept:
        dropout = dropout._replace(mask=kept_bits(device[0], device[1]))
    o, lse = attention_forward(*device, True, 0.1, dropout)
    visible = numpy.tril(numpy.ones((t, t), bool))
    expected = dropout_keep(dropout, (b, h, t, t)) & visible
    numpy.testing.assert_array_equal(asnumpy(o)[..., :t].astype(F64) != 0, expected)
    if kept and offset % 8 == 0 and t % 8 == 0:
        bits = numpy.unpackbits(asnumpy(dropout.mask), axis=-1, bitorder="little")
        stored = bits[..., :t].reshape(b, h, t, t).astype(bool)
        numpy.testing.assert_array_equal(stored & visible, expected)
    _, _, dv = attention_backward(*device, o, lse, device[2], True, 0.1, dropout)
    numpy.testing.assert_array_equal(asnumpy(dv)[..., :t].astype(F64) != 0,
                                     expected.transpose(0, 1, 3, 2))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_flash_backward_into_rows_not_16_byte_aligned(d):
    """Gradients asked into views whose rows start 4 bytes past a 16-byte boundary (the dq
    kernel's element-by-element stores) equal those written into new arrays, bit for bit."""
    b, h, t = 2, 3, 97
    _, device = strided_qkv(b, h, t, d, bfloat16, seed=d)
    g = xp.asarray(numpy.random.default_rng(5).standard_normal((b, h, t, d)).astype(bfloat16))
    o, lse = attention_forward(*device, True, d ** -0.5)
    want = attention_backward(*device, o, lse, g, True, d ** -0.5)
    views = tuple(xp.zeros((b, t, h, d + 2), bfloat16)[..., 2:].transpose(0, 2, 1, 3)
                  for _ in range(3))
    assert all(view.data.ptr % 16 == 4 for view in views)
    with poisoned_allocations():
        got = attention_backward(*device, o, lse, g, True, d ** -0.5, grads=views)
    for name, a, b_ in zip("qkv", got, want):
        numpy.testing.assert_array_equal(asnumpy(a), asnumpy(b_), err_msg=f"d{name}")


KEPT_CASES = [  # b, h, t, d, causal, p: tails of query tiles and of 128-key blocks
    (2, 3, 97, 64, True, 0.2), (1, 2, 200, 128, True, 0.3), (2, 2, 136, 64, False, 0.1),
    (1, 2, 64, 128, False, 0.5), (64, 6, 256, 64, True, 0.2),
]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("b,h,t,d,causal,p", KEPT_CASES)
def test_kept_dropout_bits_change_nothing(b, h, t, d, causal, p):
    """The backward reading the forward's kept bits gives what drawing them again gives, bit
    for bit, forward outputs included."""
    _, device = strided_qkv(b, h, t, d, bfloat16, seed=t)
    g = xp.asarray(numpy.random.default_rng(3).standard_normal((b, h, t, d)).astype(bfloat16))
    drawn = host_dropout(p, h + 1, offset=2 ** 20, head_offset=1)
    kept = drawn._replace(mask=kept_bits(device[0], device[1]))
    results = []
    for dropout in (drawn, kept):
        with poisoned_allocations():
            o, lse = attention_forward(*device, causal, d ** -0.5, dropout)
            grads = attention_backward(*device, o, lse, g, causal, d ** -0.5, dropout)
        results.append([asnumpy(a) for a in (o, lse, *grads)])
    for name, a, b_ in zip(("o", "lse", "dq", "dk", "dv"), *results):
        numpy.testing.assert_array_equal(a, b_, err_msg=name)


@requires_gpu
def test_kept_dropout_bits_are_checked():
    q, k, v = (xp.asarray(a) for a in qkv(1, 2, 16, 16, 64))
    assert kept_bits(q, k).shape == (2, 16, 16)          # 16 keys round up to a 128-key block
    assert kept_bits(q, xp.empty((1, 2, 32 * 64 + 1, 64), bfloat16)) is None   # S > 32 D
    assert kept_bits(asnumpy(q), asnumpy(k)) is None
    dropout = host_dropout(0.1, 2)
    with pytest.raises(ValueError, match="contiguous uint8"):
        attention_forward(q, k, v, True, 0.125,
                          dropout._replace(mask=xp.empty((2, 16, 8), numpy.uint8)))
    with pytest.raises(ValueError, match="plain dropout"):
        attention_forward(q, k, v, True, 0.125, dropout._replace(
            mask=kept_bits(q, k), rows=xp.arange(16, dtype=xp.int64)))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("col_start", [8, 12])      # key runs from a multiple of 8, and not
def test_flash_kernel_dropout_of_a_block_at_positions_is_bit_exact(col_start):
    """A block of a 96-token sequence (48 queries, 40 keys, each two runs of positions), not
    causal: forward and backward drop exactly what the twin drops at those positions."""
    rows, cols = position_maps(col_start)
    b, h, t, s, d = 2, 3, 48, 40, 64
    q, _, _ = qkv(b, h, t, s, d, seed=5)
    _, k, _ = qkv(b, h, s, s, d, seed=6)
    eye = numpy.broadcast_to(numpy.eye(s, d), (b, h, s, d)).astype(bfloat16)
    do = numpy.broadcast_to(numpy.eye(t, d), (b, h, t, d)).astype(bfloat16)
    dropout = host_dropout(0.5, 5, offset=2 ** 20, head_offset=1, batch_offset=1)._replace(
        rows=xp.asarray(rows), cols=xp.asarray(cols), t_global=96, s_global=96)
    device = [xp.asarray(a) for a in (q, k, eye, do)]
    o, lse = attention_forward(*device[:3], False, 0.1, dropout)
    expected = dropout_keep(dropout, (b, h, t, s))
    numpy.testing.assert_array_equal(asnumpy(o)[..., :s].astype(F64) != 0, expected)
    _, _, dv = attention_backward(*device[:3], o, lse, device[3], False, 0.1, dropout)
    numpy.testing.assert_array_equal(asnumpy(dv)[..., :t].astype(F64) != 0,
                                     expected.transpose(0, 1, 3, 2))


@requires_gpu
def test_mixing_numpy_and_cupy_arrays_is_named():
    q, k, v = qkv(1, 2, 4, 4, 64)
    device = [xp.asarray(a) for a in (q, k, v)]
    with pytest.raises(ValueError, match="NumPy and CuPy arrays cannot be mixed"):
        attention_forward(device[0], k, device[2], True, 0.125)
    o, lse = attention_forward(*device, True, 0.125)
    with pytest.raises(ValueError, match="NumPy and CuPy arrays cannot be mixed"):
        attention_backward(*device, o, lse, q, True, 0.125)


def test_attention_implementation_choice(monkeypatch):
    q, k, _ = qkv(1, 2, 4, 4, 64)
    monkeypatch.setenv("CUPYTP_ATTENTION", "flash")
    assert not cudnn_attention.applies(xp.asarray(q), xp.asarray(k), 0.0)
    assert cudnn_attention.describe() == "attention: flash (CUPYTP_ATTENTION=flash)"
    monkeypatch.setenv("CUPYTP_ATTENTION", "auto")
    assert not cudnn_attention.applies(q, k, 0.0)                  # NumPy arrays: the twin
    assert not cudnn_attention.applies(xp.asarray(q), xp.asarray(k), 0.1)    # dropout: flash
    assert not cudnn_attention.applies(xp.asarray(q), xp.asarray(k), 0.0)    # 32 scores: flash
    if on_gpu and cudnn_attention._frontend(False) is not None:
        big = xp.empty((1, 1, 2 ** 10, 64), bfloat16)                      # 2^20 scores
        assert cudnn_attention.applies(big, big, 0.0)
        monkeypatch.setenv("CUPYTP_ATTENTION", "cudnn")
        assert cudnn_attention.applies(xp.asarray(q), xp.asarray(k), 0.0)
    monkeypatch.setenv("CUPYTP_ATTENTION", "fastest")
    with pytest.raises(ValueError, match="CUPYTP_ATTENTION='fastest'"):
        cudnn_attention.applies(q, k, 0.0)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("b,h,t,d,causal,dtype", [(2, 3, 100, 64, True, bfloat16),
                                                  (1, 2, 130, 128, False, F16)])
def test_cudnn_attention_matches_twin(b, h, t, d, causal, dtype):
    pytest.importorskip("cudnn")
    host, device = strided_qkv(b, h, t, d, dtype, seed=t)
    g = numpy.random.default_rng(10).standard_normal((b, h, t, d)).astype(dtype)
    with poisoned_allocations():
        o, lse = cudnn_attention.attention_forward(*device, causal, d ** -0.5)
        grads = cudnn_attention.attention_backward(*device, o, lse, xp.asarray(g), causal,
                                                   d ** -0.5)
    o_twin, lse_twin = attention_forward_numpy(*host, causal, d ** -0.5)
    assert relative_error(o, o_twin) < 1e-2
    numpy.testing.assert_allclose(asnumpy(lse), lse_twin, rtol=1e-3, atol=1e-3)
    twin = attention_backward_numpy(*host, asnumpy(o), asnumpy(lse), g, causal, d ** -0.5)
    for name, got, want in zip("qkv", grads, twin):
        assert relative_error(got, want) < 2e-2, f"d{name}"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t,s", [(96, 160), (160, 96)])
def test_cudnn_attention_of_unequal_lengths_unmasked_matches_twin(t, s, monkeypatch):
    """A ring's block of another rank: queries and keys of different lengths, no mask (with a
    causal mask cuDNN is not chosen: its diagonal would align differently)."""
    pytest.importorskip("cudnn")
    monkeypatch.setenv("CUPYTP_ATTENTION", "cudnn")          # small: auto would take flash
    host = [a.astype(F64) for a in qkv(2, 3, t, s, 64, seed=t)]
    device = [xp.asarray(a.astype(bfloat16)) for a in host]
    assert cudnn_attention.applies(*device[:2], 0.0, causal=False)
    assert not cudnn_attention.applies(*device[:2], 0.0, causal=True)
    g = numpy.random.default_rng(3).standard_normal((2, 3, t, 64))
    o, lse = cudnn_attention.attention_forward(*device, False, 0.125)
    grads = cudnn_attention.attention_backward(*device, o, lse, xp.asarray(g.astype(bfloat16)),
                                               False, 0.125)
    o_twin, lse_twin = attention_forward_numpy(*host, False, 0.125)
    assert relative_error(o, o_twin) < 1e-2
    numpy.testing.assert_allclose(asnumpy(lse), lse_twin, rtol=1e-3, atol=1e-3)
    twin = attention_backward_numpy(*host, o_twin, lse_twin, g, False, 0.125)
    for name, got, want in zip("qkv", grads, twin):
        assert relative_error(got, want) < 2e-2, f"d{name}"


@pytest.mark.gpu
@requires_gpu
def test_cudnn_raw_entry_gives_the_public_executes_bits():
    """The frontend the GPU machines carry has the raw-address entry, and it computes what the
    public execute computes."""
    pytest.importorskip("cudnn")
    _, device = strided_qkv(2, 3, 100, 64, bfloat16, seed=5)
    o, lse = cudnn_attention.attention_forward(*device, True, 0.125)
    runner = cudnn_attention._forward_graph(*cudnn_attention._geometry(*device, o), True, 0.125)
    assert runner.raw is not None
    raw, runner.raw = runner.raw, None
    public = (cudnn_attention.like_output(device[0]), xp.empty(lse.shape + (1,), xp.float32))
    try:
        runner.run((*device, *public))
    finally:
        runner.raw = raw
    numpy.testing.assert_array_equal(asnumpy(public[0]), asnumpy(o))
    numpy.testing.assert_array_equal(asnumpy(public[1]).reshape(lse.shape), asnumpy(lse))


@pytest.mark.gpu
@requires_gpu
def test_flash_dropout_in_a_cuda_graph_draws_as_eager():
    """Replays of a captured attention with dropout read the counter base from device memory:
    each replay draws the mask that the same eager call draws."""
    arrays = qkv(2, 3, 70, 70, 64, seed=6)
    tensors = [from_local(xp.asarray(a), local_mesh(), (Replicated(),), shape=a.shape)
               for a in arrays]
    generator = Generator(21)

    def attend(q, k, v):
        return ops.scaled_dot_product_attention(q, k, v, dropout_p=0.3, generator=generator)

    eager = [asnumpy(attend(*tensors)._local).astype(F64) for _ in range(4)]
    generator.manual_seed(21)
    graphed = cupytp.cuda_graph(attend)
    for want in eager:
        numpy.testing.assert_array_equal(asnumpy(graphed(*tensors)._local).astype(F64), want)
    assert (eager[1] != eager[2]).any()
