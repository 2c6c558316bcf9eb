"""Products with a fused epilogue: the NumPy twins against float64 math written out here, and on a
GPU the cuBLASLt epilogues (and the kernels that stand in where cuBLASLt has no algorithm)
against the twins."""
import math

import numpy
import pytest

from cupytp.backend import asnumpy, bfloat16, on_gpu, xp
from cupytp.launchers import gemm_epilogue as epilogue

F32, F64 = numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)
requires_gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU and CuPy")


def random(shape, dtype, seed, scale=1.0):
    return (numpy.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def wide(v):
    return numpy.asarray(asnumpy(v), dtype=F64)


def gelu(p):
    return 0.5 * p * (1 + numpy.tanh(math.sqrt(2 / math.pi) * (p + 0.044715 * p ** 3)))


def gelu_slope(p, step=1e-6):
    return (gelu(p + step) - gelu(p - step)) / (2 * step)       # central difference


def operands(dtype, rows=6, k=8, n=5):
    return random((rows, k), dtype, 1), random((k, n), dtype, 2, 0.5), random((n,), dtype, 3)


def assert_rounded_once(got, exact, dtype):
    """got is exact rounded once to dtype: within half an ulp of dtype (plus float32 sums)."""
    assert got.dtype == dtype
    ulp = {bfloat16: 2.0 ** -8, F32: 2.0 ** -23, F64: 2.0 ** -52}[numpy.dtype(dtype)]
    numpy.testing.assert_allclose(wide(got), exact, rtol=ulp, atol=1e-6 * abs(exact).max())


@pytest.mark.parametrize("dtype", [bfloat16, F32, F64], ids=str)
def test_bias_twin_adds_the_bias_and_residual_before_its_one_rounding(dtype):
    x, w, bias = operands(dtype)
    exact = wide(x) @ wide(w) + wide(bias)
    assert_rounded_once(epilogue.matmul_bias_numpy(x, w, bias), exact, dtype)
    residual = random((6, 5), F64 if dtype == F64 else F32, 4)
    master = bias.astype(residual.dtype)
    got = epilogue.matmul_bias_numpy(x, w, master, residual)
    assert_rounded_once(got, wide(x) @ wide(w) + wide(master) + residual, residual.dtype)


@pytest.mark.parametrize("dtype", [bfloat16, F64], ids=str)
def test_bias_gelu_twin_keeps_the_pre_activation(dtype):
    x, w, bias = operands(dtype)
    pre = wide(x) @ wide(w) + wide(bias)
    out, kept = epilogue.matmul_bias_gelu_numpy(x, w, bias)
    assert_rounded_once(kept, pre, dtype)
    assert_rounded_once(out, gelu(pre), dtype)


@pytest.mark.parametrize("dtype", [bfloat16, F64], ids=str)
def test_gelu_grad_twin_is_the_chain_rule_and_its_column_sums(dtype):
    g, w, _ = operands(dtype, k=8, n=5)
    pre = random((6, 5), dtype, 5)
    w_t = numpy.ascontiguousarray(w.T).T                       # a transposed view, as in use
    d = (wide(g) @ wide(w_t)) * gelu_slope(wide(pre))
    got, sums = epilogue.matmul_gelu_grad_numpy(g, w_t, pre)
    tolerance = 1e-8 if dtype == F64 else 2.0 ** -8
    numpy.testing.assert_allclose(wide(got), d, rtol=tolerance, atol=tolerance * abs(d).max())
    numpy.testing.assert_allclose(wide(sums), d.sum(0), rtol=tolerance,
                                  atol=tolerance * abs(d).sum(0).max())
    assert got.dtype == sums.dtype == dtype


@pytest.mark.parametrize("dtype", [bfloat16, F64], ids=str)
def test_twins_without_a_bias_the_pre_activation_or_the_sums(dtype):
    """A layer without a bias: the product (plus the residual) rounded once, GeLU of the product
    alone; a forward with no backward gets no pre-activation, a gradient without a bias no
    column sums, the other outputs unchanged."""
    x, w, _ = operands(dtype)
    product = wide(x) @ wide(w)
    assert_rounded_once(epilogue.matmul_bias_numpy(x, w, None), product, dtype)
    residual = random((6, 5), F64 if dtype == F64 else F32, 4)
    assert_rounded_once(epilogue.matmul_bias_numpy(x, w, None, residual), product + residual,
                        residual.dtype)
    out, pre = epilogue.matmul_bias_gelu_numpy(x, w, None)
    assert_rounded_once(pre, product, dtype)
    assert_rounded_once(out, gelu(product), dtype)
    alone, none = epilogue.matmul_bias_gelu(x, w, None, keep_pre=False)
    assert none is None and numpy.array_equal(alone, out)
    g = random((6, 8), dtype, 5)
    d, sums = epilogue.matmul_gelu_grad(g, w, pre)
    d_alone, none = epilogue.matmul_gelu_grad(g, w, pre, sums=False)
    assert none is None and numpy.array_equal(d_alone, d) and sums.shape == (5,)


@pytest.mark.parametrize("dtype,out_dtype", [(bfloat16, F32), (bfloat16, bfloat16), (F64, F64)],
                         ids=str)
def test_bias_grad_twin_is_the_weight_gradient_and_the_output_gradient_summed(dtype, out_dtype):
    x, g = random((7, 4), dtype, 6), random((7, 3), dtype, 7)
    product, sums = epilogue.matmul_bias_grad_numpy(x.T, g, out_dtype)
    assert_rounded_once(product, wide(x).T @ wide(g), out_dtype)
    assert_rounded_once(sums, wide(g).sum(0), out_dtype)


def test_empty_rows_give_empty_products_and_zero_sums():
    x, w, bias = operands(F64, rows=0)
    assert epilogue.matmul_bias(x, w, bias).shape == (0, 5)
    product, sums = epilogue.matmul_bias_grad(x.T, numpy.zeros((0, 5)), F64)
    numpy.testing.assert_array_equal(product, numpy.zeros((8, 5)))
    numpy.testing.assert_array_equal(sums, numpy.zeros(5))


def test_bad_operands_are_named():
    x, w, bias = operands(bfloat16)
    with pytest.raises(ValueError, match=r"bias must be \(5,\) of the output's dtype"):
        epilogue.matmul_bias(x, w, bias.astype(F32))
    with pytest.raises(ValueError, match="residual must be"):
        epilogue.matmul_bias(x, w, bias, numpy.zeros((6, 4), bfloat16))
    with pytest.raises(ValueError, match=r"matrices \(M, K\) and \(K, N\)"):
        epilogue.matmul_bias_gelu(x, w[:4], bias)
    with pytest.raises(ValueError, match="pre must be"):
        epilogue.matmul_gelu_grad(x, w, numpy.zeros((6, 5), F32))


# ---- on a GPU: cuBLASLt's epilogues (and the stand-in kernels) against the twins -------------
def transposed_view(a):
    """a's values on the device as a transposed view of a C-contiguous array (a.T's)."""
    return xp.ascontiguousarray(xp.asarray(a).T).T


def device_cases(dtype):
    """(name, function, device arguments, twin result) of each epilogue for dtype."""
    x, w, bias = operands(dtype, rows=64, k=96, n=128)
    residual = random((64, 128), F64 if dtype == F64 else F32, 4)
    pre, g = random((64, 128), dtype, 5), random((64, 96), dtype, 6)
    master = bias.astype(residual.dtype)
    d = xp.asarray
    out_dtype = F64 if dtype == F64 else F32
    return [
        ("bias", epilogue.matmul_bias, (d(x), d(w), d(bias)),
         epilogue.matmul_bias_numpy(x, w, bias)),
        ("bias+residual", epilogue.matmul_bias, (d(x), d(w), d(master), d(residual)),
         epilogue.matmul_bias_numpy(x, w, master, residual)),
        ("bias_gelu", epilogue.matmul_bias_gelu, (d(x), d(w), d(bias)),
         epilogue.matmul_bias_gelu_numpy(x, w, bias)),
        ("gelu_grad", epilogue.matmul_gelu_grad, (d(g), transposed_view(w), d(pre)),
         epilogue.matmul_gelu_grad_numpy(g, w, pre)),
        ("bias_grad", epilogue.matmul_bias_grad, (transposed_view(x.T), d(pre), out_dtype),
         epilogue.matmul_bias_grad_numpy(x.T, pre, out_dtype)),
        ("residual", epilogue.matmul_bias, (d(x), d(w), None, d(residual)),
         epilogue.matmul_bias_numpy(x, w, None, residual)),
        ("gelu", epilogue.matmul_bias_gelu, (d(x), d(w), None),
         epilogue.matmul_bias_gelu_numpy(x, w, None)),
        ("gelu without pre", epilogue.matmul_bias_gelu, (d(x), d(w), None, False),
         epilogue.matmul_bias_gelu_numpy(x, w, None, False)),
        ("bias_gelu without pre", epilogue.matmul_bias_gelu, (d(x), d(w), d(bias), False),
         epilogue.matmul_bias_gelu_numpy(x, w, bias, False)),
        ("gelu_grad without sums", epilogue.matmul_gelu_grad,
         (d(g), transposed_view(w), d(pre), False), epilogue.matmul_gelu_grad_numpy(g, w, pre,
                                                                                     False)),
    ]


def assert_matches_twin(got, want, name):
    for got_part, want_part in zip(got if isinstance(got, tuple) else (got,),
                                   want if isinstance(want, tuple) else (want,)):
        if want_part is None:
            assert got_part is None, name
            continue
        assert got_part.dtype == want_part.dtype, name
        scale = abs(wide(want_part)).max()
        tolerance = 1e-10 if want_part.dtype == F64 else 2.0 ** -7
        numpy.testing.assert_allclose(wide(got_part), wide(want_part), rtol=tolerance,
                                      atol=tolerance * scale, err_msg=name)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [bfloat16, F32, F64], ids=str)
def test_epilogues_match_their_twins(dtype):
    for name, function, arguments, want in device_cases(dtype):
        assert_matches_twin(function(*arguments), want, name)


@pytest.mark.gpu
@requires_gpu
def test_bf16_epilogues_run_in_cublaslt():
    """The GPT-2 products of a bf16 step find a cuBLASLt algorithm for their epilogue."""
    for name, function, arguments, _ in device_cases(bfloat16):
        epilogue._plans.clear()
        function(*arguments)
        assert all(plan is not None for plan in epilogue._plans.values()), name


@pytest.mark.gpu
@requires_gpu
def test_without_cublaslt_the_kernels_give_the_same_values(monkeypatch):
    monkeypatch.setattr(epilogue.gemm, "use_cublaslt", lambda: False)
    monkeypatch.setattr(epilogue, "_plans", {})
    for name, function, arguments, want in device_cases(bfloat16):
        assert_matches_twin(function(*arguments), want, name)
    assert not any(epilogue._plans.values())


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("limit,value", [("DGELU_EPILOGUE_MAX", 64 * 128),
                                         ("DGELU_EPILOGUE_MAX_WIDTH", 96)])
def test_large_gelu_gradients_run_the_kernels(monkeypatch, limit, value):
    """From DGELU_EPILOGUE_MAX elements on, or from a product over DGELU_EPILOGUE_MAX_WIDTH
    columns of g, the GeLU gradient is the product and the kernels: the twin's values, and no
    cuBLASLt plan made for it."""
    monkeypatch.setattr(epilogue, limit, value)
    monkeypatch.setattr(epilogue, "_plans", {})
    name, function, arguments, want = device_cases(bfloat16)[3]
    assert name == "gelu_grad" and arguments[2].size == 64 * 128 and arguments[0].shape[1] == 96
    assert_matches_twin(function(*arguments), want, name)
    assert not epilogue._plans


@pytest.mark.gpu
@requires_gpu
def test_each_bias_gets_its_own_descriptor_and_the_oldest_is_dropped(monkeypatch):
    """One plan serves products with different biases and pre-activations, alternating, through
    a descriptor per bias pointer; with room for one descriptor, each call makes a new one."""
    x, w, _ = operands(bfloat16, rows=64, k=96, n=128)
    biases = [random((128,), bfloat16, seed) for seed in (7, 8, 9)]
    for room in (epilogue.gemm.EPILOGUE_DESCRIPTORS, 1):
        monkeypatch.setattr(epilogue.gemm, "EPILOGUE_DESCRIPTORS", room)
        monkeypatch.setattr(epilogue, "_plans", {})
        device_biases = [xp.asarray(bias) for bias in biases]
        for bias, device_bias in [*zip(biases, device_biases)] * 2:
            assert_matches_twin(epilogue.matmul_bias_gelu(xp.asarray(x), xp.asarray(w),
                                                          device_bias),
                                epilogue.matmul_bias_gelu_numpy(x, w, bias), "bias_gelu")
        (plan,) = epilogue._plans.values()
        assert len(plan.lt.by_bias) == min(room, len(biases))
