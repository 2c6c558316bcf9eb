"""The kernels of Llama-family models: each NumPy twin against an independent reference (float64
formulas, finite differences, Hugging Face's rotate-half written out, attention with key/value
heads repeated), and on a GPU each kernel against its twin (RMSNorm, rotary in place and out of
place on strided views, the SiLU gate, flash and cuDNN attention with grouped key/value heads,
the cross-entropy over a 128k vocabulary)."""
import numpy
import pytest

from cupytp.backend import asnumpy, bfloat16, xp
from cupytp.launchers import compute_dtype, dtype_suffix
from cupytp.launchers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from cupytp.launchers.flash_attention import (
    HeadGroups, attention_backward, attention_backward_numpy, attention_forward,
    attention_forward_numpy)
from cupytp.launchers.rmsnorm import (
    rms_norm_backward, rms_norm_backward_numpy, rms_norm_forward, rms_norm_forward_numpy)
from cupytp.launchers.rotary import rotary, rotary_numpy
from cupytp.launchers.swiglu import swiglu, swiglu_backward, swiglu_backward_numpy, swiglu_numpy
from cupytp.nn.rotary import rope_frequencies
from test_kernels import F16, F32, F64, assert_close, poisoned_allocations, random, requires_gpu


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar f at float64 x."""
    grad = numpy.zeros_like(x)
    for index in numpy.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        grad[index] = (f(plus) - f(minus)) / (2 * eps)
    return grad


# ---- RMSNorm ------------------------------------------------------------------------------------
def test_rms_norm_twin_matches_formula_and_finite_differences():
    x, w, g = random((3, 5), F64, 1), random((5,), F64, 2), random((3, 5), F64, 3)
    add = random((3, 5), F64, 4)
    y, rstd = rms_norm_forward_numpy(x, w, 1e-5)
    expected = x / numpy.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * w
    numpy.testing.assert_allclose(y, expected, rtol=1e-14)
    assert rstd.shape == (3, 1) and rstd.dtype == F64
    dx, dw = rms_norm_backward_numpy(g, x, rstd, w, add=add, weight_grad=True)

    def loss(x_, w_=w):
        return (rms_norm_forward_numpy(x_, w_, 1e-5)[0] * g).sum()
    numpy.testing.assert_allclose(dx - add, numeric_grad(loss, x), rtol=1e-7, atol=1e-9)
    numpy.testing.assert_allclose(dw, numeric_grad(lambda w_: loss(x, w_), w), rtol=1e-7)
    assert rms_norm_backward_numpy(g, x, rstd, None).shape == x.shape


def test_rms_norm_autocast_output_and_bad_input():
    x = random((2, 8), F32, 5)
    y, _ = rms_norm_forward(x, numpy.ones(8, F32), 1e-6, bfloat16)
    assert y.dtype == bfloat16
    with pytest.raises(ValueError, match="add must have dx's dtype"):
        rms_norm_backward(y, x, numpy.ones((2, 1), F32), None, F32, add=numpy.ones((2, 8), F64))


# ---- rotary -------------------------------------------------------------------------------------
def hf_rotary(x, cos, sin, start):
    """Hugging Face's apply_rotary_pos_emb: x cos + rotate_half(x) sin, tables cat(f, f)."""
    t, half = x.shape[1], x.shape[-1] // 2
    c = numpy.concatenate([cos, cos], -1)[start:start + t][None, :, None]
    s = numpy.concatenate([sin, sin], -1)[start:start + t][None, :, None]
    rotated = numpy.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * c + rotated * s


def tables(positions, d, dtype=F64, theta=10000.0):
    angles = numpy.outer(numpy.arange(positions), rope_frequencies(d, theta))
    return numpy.cos(angles).astype(dtype), numpy.sin(angles).astype(dtype)


def test_rotary_twin_is_hugging_face_rotate_half_and_inverts():
    x = random((2, 5, 3, 8), F64, 6)
    cos, sin = tables(16, 8)
    y = rotary(x, cos, sin, start=4)
    numpy.testing.assert_allclose(y, hf_rotary(x, cos, sin, 4), rtol=1e-14, atol=1e-15)
    numpy.testing.assert_allclose(rotary(y, cos, sin, 4, inverse=True), x, rtol=1e-13)
    inplace = x.copy()
    assert rotary(inplace, cos, sin, 4, out=inplace) is inplace
    numpy.testing.assert_array_equal(inplace, y)
    with pytest.raises(ValueError, match="outside the tables"):
        rotary(x, cos, sin, start=12)
    with pytest.raises(ValueError, match="must be a contiguous float64 table"):
        rotary(x, cos.astype(F32), sin, 0)


def test_rope_frequencies_llama3_scaling():
    """Llama 3.1's rule: wavelengths under original/high_freq_factor kept, over
    original/low_freq_factor divided by the factor, blended between."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    base = rope_frequencies(32, 500000.0)
    scaled = rope_frequencies(32, 500000.0, scaling)
    wavelength = 2 * numpy.pi / base
    short, long_ = wavelength < 64 / 4, wavelength > 64
    assert short.any() and long_.any() and (~short & ~long_).any()
    numpy.testing.assert_array_equal(scaled[short], base[short])
    numpy.testing.assert_allclose(scaled[long_], base[long_] / 8, rtol=1e-15)
    middle = ~short & ~long_
    assert ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all()
    numpy.testing.assert_allclose(rope_frequencies(32, 1e4, {"rope_type": "linear",
                                                             "factor": 2.0}),
                                  rope_frequencies(32, 1e4) / 2)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        rope_frequencies(32, 1e4, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="lacks 'low_freq_factor'"):
        rope_frequencies(32, 1e4, {"rope_type": "llama3", "factor": 2.0})


# ---- SiLU gate ----------------------------------------------------------------------------------
def test_swiglu_twin_matches_formula_and_finite_differences():
    h, dy = random((2, 3, 2, 4), F64, 7, scale=2.0), random((2, 3, 4), F64, 8)
    g, u = h[..., 0, :], h[..., 1, :]
    numpy.testing.assert_allclose(swiglu_numpy(h), g / (1 + numpy.exp(-g)) * u, rtol=1e-14)
    dh, y = swiglu_backward_numpy(h, dy, recompute=True)
    numpy.testing.assert_array_equal(y, swiglu_numpy(h))
    numpy.testing.assert_allclose(dh, numeric_grad(lambda h_: (swiglu_numpy(h_) * dy).sum(), h),
                                  rtol=1e-7, atol=1e-10)
    with pytest.raises(ValueError, match="gate and up side by side"):
        swiglu(numpy.zeros((2, 3, 4)))
    assert not numpy.isnan(swiglu_numpy(numpy.full((1, 2, 3), -1e4, F32))).any()


# ---- grouped-query attention --------------------------------------------------------------------
def qkv_grouped(b, h, hk, t, d, dtype=bfloat16, seed=0):
    rng = numpy.random.default_rng(seed)
    return (rng.standard_normal((b, n, t, d)).astype(dtype) for n in (h, hk, hk))


@pytest.mark.parametrize("h,hk,groups", [(4, 2, None), (6, 1, None), (2, 2, HeadGroups(4, 2)),
                                         (3, 3, HeadGroups(2, 1))])
def test_grouped_flash_twin_is_attention_with_repeated_heads(h, hk, groups):
    """Query head i reads key/value head (i + offset) // group: the twin equals plain attention
    over k and v repeated per query head, forward and backward (dk, dv summed over each
    group; a key/value head no query head reads gets zeros)."""
    b, t, d = 2, 5, 64
    q, k, v = qkv_grouped(b, h, hk, t, d)
    group, offset = groups or (h // hk, 0)
    index = (numpy.arange(h) + offset) // group
    g = random((b, h, t, d), bfloat16, 9)
    o, lse = attention_forward_numpy(q, k, v, True, 0.125, groups=groups)
    o_ref, lse_ref = attention_forward_numpy(q, k[:, index], v[:, index], True, 0.125)
    numpy.testing.assert_array_equal(o.astype(F64), o_ref.astype(F64))
    numpy.testing.assert_array_equal(lse, lse_ref)
    dq, dk, dv = attention_backward_numpy(q, k, v, o, lse, g, True, 0.125, groups=groups)
    assert dk.shape == k.shape and dv.shape == v.shape
    ref = attention_backward_numpy(q, k[:, index], v[:, index], o, lse, g, True, 0.125)
    numpy.testing.assert_array_equal(dq.astype(F64), ref[0].astype(F64))
    for got, full in zip((dk, dv), ref[1:]):
        summed = numpy.zeros(k.shape, F64)
        numpy.add.at(summed, (slice(None), index), full.astype(F64))
        assert_close(got, summed, bfloat16)
        unread = sorted(set(range(hk)) - set(index))
        assert not got[:, unread].astype(F64).any()


def test_grouped_heads_outside_k_are_an_error():
    q, k, v = qkv_grouped(1, 4, 2, 3, 64)
    with pytest.raises(ValueError, match="outside k's 2 heads"):
        attention_forward(q, k, v, True, 0.125, groups=HeadGroups(1))
    with pytest.raises(ValueError, match="do not group evenly"):
        attention_forward(q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1), True,
                          0.125)


# ---- GPU: kernels against the twins -------------------------------------------------------------
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype,out_dtype", [(F32, F32), (F64, F64), (bfloat16, bfloat16),
                                             (F16, F16), (F32, bfloat16)])
@pytest.mark.parametrize("cols", [64, 2048, 3000, 17000])
def test_rms_norm_kernels_match_twin(dtype, out_dtype, cols):
    """Cached (row in registers) and streaming forms, with and without the weight, the added
    gradient and the weight's gradient."""
    x, w = random((37, cols), dtype, 1), random((cols,), dtype, 2, scale=0.5)
    g, add = random((37, cols), out_dtype, 3), random((37, cols), dtype, 4)
    with poisoned_allocations():
        y, rstd = rms_norm_forward(xp.asarray(x), xp.asarray(w), 1e-5, out_dtype)
        dx, dw = rms_norm_backward(xp.asarray(g), xp.asarray(x), rstd, xp.asarray(w), dtype,
                                   xp.asarray(add), weight_grad=True)
        dx_plain = rms_norm_backward(xp.asarray(g), xp.asarray(x), rstd, None, dtype)
    y_twin, rstd_twin = rms_norm_forward_numpy(x, w, 1e-5, out_dtype)
    dx_twin, dw_twin = rms_norm_backward_numpy(g, x, rstd_twin, w, dtype, add, True)
    assert y.dtype == out_dtype and dx.dtype == dtype and dw.dtype == compute_dtype(dtype)
    assert_close(y, y_twin, out_dtype)
    assert_close(rstd, rstd_twin, compute_dtype(dtype))
    assert_close(dx, dx_twin, dtype)
    rtol = 1e-10 if dtype == F64 else 1e-3
    numpy.testing.assert_allclose(asnumpy(dw), dw_twin, rtol=rtol, atol=rtol)
    assert_close(dx_plain, rms_norm_backward_numpy(g, x, rstd_twin, None, dtype), dtype)
    if dtype == F32:        # dx once more in bf16 and its column sums, in the pass or after
        for with_sum in (True, False):
            with poisoned_allocations():
                dx, dw, (copy, sums) = rms_norm_backward(
                    xp.asarray(g), xp.asarray(x), rstd, xp.asarray(w), dtype, xp.asarray(add),
                    True, (bfloat16, with_sum))
            *_, (_, sums_twin) = rms_norm_backward_numpy(g, x, rstd_twin, w, dtype, add, True,
                                                         (bfloat16, with_sum))
            assert copy.dtype == bfloat16 and (sums is None) == (not with_sum)
            numpy.testing.assert_array_equal(asnumpy(copy), asnumpy(dx).astype(bfloat16))
            if with_sum:
                numpy.testing.assert_allclose(asnumpy(sums) / 37 ** 0.5, sums_twin / 37 ** 0.5,
                                              rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("d", [64, 128, 6])
def test_rotary_kernel_matches_twin_strided_and_in_place(dtype, d):
    """k of a (B, T, 2, Hk, D) k|v product, rotated in place (the fused path) and out of place,
    forward and back."""
    kv = random((2, 9, 2, 3, d), dtype, 11)
    cos, sin = tables(32, d, compute_dtype(dtype))
    device = xp.asarray(kv)
    with poisoned_allocations():
        out = rotary(device[:, :, 0], xp.asarray(cos), xp.asarray(sin), start=7)
    twin = rotary_numpy(kv[:, :, 0], cos, sin, 7)
    assert_close(out, twin, dtype)
    rotary(device[:, :, 0], xp.asarray(cos), xp.asarray(sin), 7, inverse=True,
           out=device[:, :, 0])
    assert_close(device[:, :, 0], rotary_numpy(kv[:, :, 0], cos, sin, 7, inverse=True), dtype)
    numpy.testing.assert_array_equal(asnumpy(device[:, :, 1]).astype(F64),
                                     kv[:, :, 1].astype(F64))      # v untouched


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [F32, F64, bfloat16, F16], ids=dtype_suffix)
@pytest.mark.parametrize("shape", [(3, 2, 8), (5, 7, 2, 1001)])
def test_swiglu_kernels_match_twin(dtype, shape):
    h, dy = random(shape, dtype, 12, scale=3.0), random(shape[:-2] + shape[-1:], dtype, 13)
    with poisoned_allocations():
        y = swiglu(xp.asarray(h))
        dh, again = swiglu_backward(xp.asarray(h), xp.asarray(dy), recompute=True)
    assert_close(y, swiglu_numpy(h), dtype)
    assert_close(dh, swiglu_backward_numpy(h, dy), dtype)
    numpy.testing.assert_array_equal(asnumpy(again).astype(F64), asnumpy(y).astype(F64))


def relative_error(got, want):
    got, want = asnumpy(got).astype(F64), numpy.asarray(want).astype(F64)
    assert numpy.isfinite(got).all(), "non-finite values (an unwritten element?)"
    return numpy.linalg.norm(got - want) / max(numpy.linalg.norm(want), 1e-30)


GQA_CASES = [  # b, h, hk, groups, t, d, causal, dtype
    (2, 8, 2, None, 130, 64, True, bfloat16), (1, 4, 1, None, 77, 128, True, bfloat16),
    (2, 6, 3, None, 64, 128, False, F16), (1, 2, 2, HeadGroups(4, 2), 100, 64, True, bfloat16),
    (1, 4, 4, HeadGroups(8, 12), 65, 128, True, bfloat16),
]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("b,h,hk,groups,t,d,causal,dtype", GQA_CASES)
def test_grouped_flash_kernels_match_twin(b, h, hk, groups, t, d, causal, dtype):
    """Key/value heads read in place by their query heads (plain groups, and the offsets of a
    rank that holds every key/value head but some query heads), forward and backward."""
    q, k, v = qkv_grouped(b, h, hk, t, d, dtype, seed=t)
    g = random((b, h, t, d), dtype, 14)
    device = [xp.asarray(a) for a in (q, k, v)]
    with poisoned_allocations():
        o, lse = attention_forward(*device, causal, d ** -0.5, groups=groups)
        grads = attention_backward(*device, o, lse, xp.asarray(g), causal, d ** -0.5,
                                   groups=groups)
    o_twin, lse_twin = attention_forward_numpy(q, k, v, causal, d ** -0.5, groups=groups)
    assert relative_error(o, o_twin) < 1e-2
    numpy.testing.assert_allclose(asnumpy(lse), lse_twin, rtol=1e-4, atol=1e-4)
    twin = attention_backward_numpy(q, k, v, asnumpy(o), asnumpy(lse), g, causal, d ** -0.5,
                                    groups=groups)
    for name, got, want in zip("qkv", grads, twin):
        assert relative_error(got, want) < 2e-2, f"d{name}"


@pytest.mark.gpu
@requires_gpu
def test_cudnn_grouped_attention_matches_twin():
    pytest.importorskip("cudnn")
    from cupytp.launchers import cudnn_attention
    if not cudnn_attention._builds_grouped_graphs():
        pytest.skip("this cuDNN builds no grouped-query graphs (flash serves them)")
    q, k, v = qkv_grouped(2, 8, 2, 256, 128, bfloat16, seed=3)
    g = random((2, 8, 256, 128), bfloat16, 15)
    device = [xp.asarray(a) for a in (q, k, v)]
    with poisoned_allocations():
        o, lse = cudnn_attention.attention_forward(*device, True, 128 ** -0.5)
        grads = cudnn_attention.attention_backward(*device, o, lse, xp.asarray(g), True,
                                                   128 ** -0.5)
    o_twin, lse_twin = attention_forward_numpy(q, k, v, True, 128 ** -0.5)
    assert relative_error(o, o_twin) < 1e-2
    twin = attention_backward_numpy(q, k, v, asnumpy(o), asnumpy(lse), g, True, 128 ** -0.5)
    for name, got, want in zip("qkv", grads, twin):
        assert relative_error(got, want) < 2e-2, f"d{name}"
    with pytest.raises(ValueError, match="groups query heads only plainly"):
        cudnn_attention.attention_forward(*device, True, 0.1, groups=HeadGroups(4, 1))


@pytest.mark.gpu
@requires_gpu
def test_cross_entropy_kernels_cope_with_a_128k_vocabulary():
    """Llama 3's 128256 columns in one block per row, bf16 logits: the kernels against the
    twin, with a vocabulary shard at an offset and padding columns past vocab_size."""
    vocab = 128256
    logits = random((3, vocab), bfloat16, 16, scale=4.0)
    targets = numpy.array([0, vocab - 1, 70000])
    grad = numpy.ones(3, F32) / 3
    for offset, size in ((0, vocab), (64128, vocab)):
        shard = numpy.ascontiguousarray(logits[:, offset:])
        m, stats = cross_entropy_forward(xp.asarray(shard), xp.asarray(targets), offset, size,
                                         -100)
        m_twin, stats_twin = cross_entropy_forward(shard, targets, offset, size, -100)
        numpy.testing.assert_allclose(asnumpy(m), m_twin, rtol=1e-6)
        numpy.testing.assert_allclose(asnumpy(stats), stats_twin, rtol=1e-4)
    m, stats = cross_entropy_forward(xp.asarray(logits), xp.asarray(targets), 0, vocab, -100)
    dx = cross_entropy_backward(xp.asarray(logits), m, xp.ascontiguousarray(stats[:, 0]),
                                xp.asarray(targets), xp.asarray(grad), 0, vocab, -100)
    twin = cross_entropy_backward(logits, asnumpy(m), asnumpy(stats[:, 0]).copy(), targets,
                                  grad, 0, vocab, -100)
    assert relative_error(dx, twin) < 1e-2
