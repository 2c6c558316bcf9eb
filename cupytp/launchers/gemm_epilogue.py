"""Matrix products with a fused epilogue (cuBLASLt's): a linear layer's bias, GeLU, residual
addition and bias gradient computed inside the product rather than by kernels of their own, which
saves each a launch, an allocation and a pass over the product (on a small model's step, host
time; on a large one, memory traffic).

    matmul_bias(x, w, bias, residual=None)          -> x @ w + bias (+ residual)
    matmul_bias_gelu(x, w, bias, keep_pre=True)     -> (gelu(p), p) with p = x @ w + bias
    matmul_gelu_grad(g, w_t, pre, sums=True)        -> (d, d summed over rows),
                                                       d = (g @ w_t) * gelu'(pre)
    matmul_bias_grad(x_t, g, out_dtype)             -> (x_t @ g, g summed over rows), out_dtype

A layer without a bias passes None (the epilogue without the bias: a residual alone is the
product's C); `keep_pre=False` leaves out the pre-activation p (None in its place: a forward
that no backward follows writes no auxiliary matrix), `sums=False` the gradient's column sums.

Operands are 2-D: x and g (rows, K), w (K, N), bias (N,); w_t and x_t may be transposed views of
C-contiguous arrays (a weight's and an input's). One float dtype for the product's operands; the
bias of `matmul_bias` and `matmul_bias_gelu` has the output's dtype, which is x's, or with a
residual the residual's (x's or its compute dtype: autocast's float32 residual stream and master
bias beside 16-bit products). `matmul_gelu_grad`'s sums have g's dtype (cuBLASLt's bias gradient
has the output's type).

The math, as the NumPy twins compute it: the product in float32 (float64 for float64), the
epilogue applied to it unrounded (GeLU is GPT-2's tanh form), one rounding to the output dtype;
the sums over rows accumulate in float32. On a GPU without a cuBLASLt algorithm for the product
(or with CUPYTP_CUBLASLT=0, or operands off cuBLASLt's alignment) the same values come from the
product, rounded, and the bias_add / gelu / column_sum kernels (the GeLU gradient's kernel sums
its columns in the same pass); so do float64 products, whose
cuBLASLt GeLU epilogues are single-precision math, and GeLU gradients of at least
DGELU_EPILOGUE_MAX elements or from a product over DGELU_EPILOGUE_MAX_WIDTH columns of g or more,
where cuBLASLt runs the epilogue as a pass of its own that is slower than the two kernels (H100,
bf16, (rows x 768) @ (768 x 3072): 16384 rows 467-471 us against 318-449 us for the kernels;
GPT-2 124M's captured step, 8192 rows, 19.6-19.7 ms through the epilogue against 18.7 through
the kernels; the small GPT's (16384 x 384) @ (384 x 1536) 5.39-5.41 ms against 5.54-5.56, so
narrower products keep the epilogue).
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import compute_dtype, is_device_array
from cupytp.launchers import bias_add, column_sum as column_sums, gelu as gelus, gemm

# cublasLtEpilogue_t
_DEFAULT, _BIAS, _GELU, _GELU_BIAS, _GELU_AUX, _GELU_AUX_BIAS = 1, 4, 32, 36, 160, 164
_DGELU, _DGELU_BGRAD, _BGRADA = 192, 208, 256
_AUX = (_GELU_AUX, _GELU_AUX_BIAS, _DGELU, _DGELU_BGRAD)   # epilogues with an auxiliary matrix
_BIAS_ALIGNMENT = 16
DGELU_EPILOGUE_MAX = 2 ** 25    # elements of a GeLU gradient from which the kernels run it
DGELU_EPILOGUE_MAX_WIDTH = 512  # columns of g (the product's inner dimension) from which they do
_plans = {}             # (epilogue, operands' signature) -> gemm.Product with cuBLASLt, or None


def matmul_bias(x, w, bias, residual=None):
    out_dtype = x.dtype if residual is None else residual.dtype
    _check("matmul_bias", x, w, bias=bias, out_dtype=out_dtype)
    if residual is not None and (residual.shape != (x.shape[0], w.shape[1]) or
                                 out_dtype not in (x.dtype, compute_dtype(x.dtype))):
        raise ValueError(f"matmul_bias: the residual must be ({x.shape[0]}, {w.shape[1]}) of "
                         f"{x.dtype} or {compute_dtype(x.dtype)}, got {residual.shape} "
                         f"{residual.dtype}")
    if not is_device_array(x):
        return matmul_bias_numpy(x, w, bias, residual)
    if bias is None and residual is None:
        return gemm.matmul(x, w)
    product = _plan(_DEFAULT if bias is None else _BIAS, x, w, out_dtype, residual is not None)
    if product is not None and _aligned((x, w, residual), bias):
        out = xp.empty((x.shape[0], w.shape[1]), dtype=out_dtype)
        product.lt.run(w.data.ptr, x.data.ptr, out.data.ptr,
                       None if residual is None else residual.data.ptr, _pointer(bias))
        return out
    y = gemm.matmul(x, w)
    if bias is None:
        return residual + y
    if residual is None:
        return bias_add.bias_add(y, bias)
    if bias_add.residual_applies(y, bias, residual):
        return bias_add.bias_residual_add(y, bias, residual)
    return bias_add.bias_add(y, bias) + residual


def matmul_bias_gelu(x, w, bias, keep_pre=True):
    _check("matmul_bias_gelu", x, w, bias=bias, out_dtype=x.dtype)
    if not is_device_array(x):
        return matmul_bias_gelu_numpy(x, w, bias, keep_pre)
    epilogue = {(True, True): _GELU_AUX_BIAS, (True, False): _GELU_AUX, (False, True): _GELU_BIAS,
                (False, False): _GELU}[keep_pre, bias is not None]
    product = _plan(epilogue, x, w, x.dtype, False)
    if product is not None and _aligned((x, w), bias):
        out = xp.empty((x.shape[0], w.shape[1]), dtype=x.dtype)
        pre = xp.empty_like(out) if keep_pre else None
        product.lt.run(w.data.ptr, x.data.ptr, out.data.ptr, None, _pointer(bias),
                       _pointer(pre))
        return out, pre
    pre = gemm.matmul(x, w)
    pre = pre if bias is None else bias_add.bias_add(pre, bias)
    return gelus.gelu(pre), (pre if keep_pre else None)


def matmul_gelu_grad(g, w_t, pre, sums=True):
    _check("matmul_gelu_grad", g, w_t, out_dtype=g.dtype)
    if pre.shape != (g.shape[0], w_t.shape[1]) or pre.dtype != g.dtype:
        raise ValueError(f"matmul_gelu_grad: pre must be ({g.shape[0]}, {w_t.shape[1]}) of "
                         f"{g.dtype}, got {pre.shape} {pre.dtype}")
    if not is_device_array(g):
        return matmul_gelu_grad_numpy(g, w_t, pre, sums)
    epilogue = pre.size < DGELU_EPILOGUE_MAX and g.shape[1] < DGELU_EPILOGUE_MAX_WIDTH
    product = _plan(_DGELU_BGRAD if sums else _DGELU, g, w_t, g.dtype, False) if epilogue \
        else None
    if product is not None and _aligned((g, w_t, pre)):
        d = xp.empty(pre.shape, dtype=g.dtype)
        column_sums_out = xp.empty(pre.shape[1:], dtype=g.dtype) if sums else None
        product.lt.run(w_t.data.ptr, g.data.ptr, d.data.ptr, None, _pointer(column_sums_out),
                       pre.data.ptr)
        return d, column_sums_out
    product = gemm.matmul(g, w_t)
    if not sums:
        return gelus.gelu_backward(pre, product), None
    d, total = gelus.gelu_backward(pre, product, sums=True)        # one pass: dh and its sums
    return d, total.astype(g.dtype, copy=False)


def matmul_bias_grad(x_t, g, out_dtype):
    out_dtype = numpy.dtype(out_dtype)
    _check("matmul_bias_grad", x_t, g, out_dtype=out_dtype)
    if not is_device_array(g):
        return matmul_bias_grad_numpy(x_t, g, out_dtype)
    product = _plan(_BGRADA, x_t, g, out_dtype, False)
    if product is not None and _aligned((x_t, g)):
        out = xp.empty((x_t.shape[0], g.shape[1]), dtype=out_dtype)
        sums = xp.empty(g.shape[1:], dtype=out_dtype)
        product.lt.run(g.data.ptr, x_t.data.ptr, out.data.ptr, None, sums.data.ptr)
        return out, sums
    return gemm.matmul(x_t, g, out_dtype), column_sums.column_sum(g, dtype=out_dtype)


def _check(name, a, b, bias=None, out_dtype=None):
    gemm.product_dtype(a.dtype, b.dtype, None)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{name}: operands must be matrices (M, K) and (K, N), got {a.shape} "
                         f"and {b.shape}")
    if bias is not None and (bias.shape != (b.shape[1],) or bias.dtype != out_dtype):
        raise ValueError(f"{name}: the bias must be ({b.shape[1]},) of the output's dtype "
                         f"{out_dtype}, got {bias.shape} {bias.dtype}")


def _plan(epilogue, a, b, out_dtype, plus_c):
    """The cuBLASLt product a @ b (+ C) with `epilogue` for operands like a and b, or None
    where cuBLASLt offers none (worked out once per signature)."""
    key = (epilogue, a.shape, a.strides, b.shape, b.strides, a.dtype, out_dtype, plus_c)
    try:
        return _plans[key]
    except KeyError:
        pass
    a_t, b_t = gemm.transposed(a), gemm.transposed(b)
    product = None
    if a_t is not None and b_t is not None and 0 not in a.shape + b.shape and \
            a.dtype != numpy.float64 and gemm.use_cublaslt():
        aux_ld = b.shape[1] if epilogue in _AUX else None
        product = gemm.Product(a, b, a_t, b_t, out_dtype, (a.shape[0], b.shape[1]),
                               (epilogue, aux_ld), plus_c)
        product = product if product.lt is not None else None
    _plans[key] = product
    return product


def _pointer(array):
    """A device array's address, 0 for None."""
    return 0 if array is None else array.data.ptr


def _aligned(matrices, bias=None):
    """True when every matrix starts on cuBLASLt's operand alignment and the bias on 16 bytes."""
    pointers = 0
    for matrix in matrices:
        if matrix is not None:
            pointers |= matrix.data.ptr
    return not pointers % gemm.LT_ALIGNMENT and (bias is None or
                                                 not bias.data.ptr % _BIAS_ALIGNMENT)


# ---- NumPy twins ---------------------------------------------------------------------------------
def _product(a, b):
    """a @ b unrounded: float32 for 16-bit operands."""
    return gemm.matmul_numpy(a, b, compute_dtype(a.dtype))


def matmul_bias_numpy(x, w, bias, residual=None):
    """NumPy twin of `matmul_bias`."""
    compute = compute_dtype(x.dtype)
    y = _product(x, w)
    if residual is not None:
        y = y + residual.astype(compute)
    y = y if bias is None else y + bias.astype(compute)
    return y.astype(x.dtype if residual is None else residual.dtype)


def matmul_bias_gelu_numpy(x, w, bias, keep_pre=True):
    """NumPy twin of `matmul_bias_gelu`."""
    pre = _product(x, w)
    pre = pre if bias is None else pre + bias.astype(compute_dtype(x.dtype))
    return gelus.gelu_numpy(pre).astype(x.dtype), (pre.astype(x.dtype) if keep_pre else None)


def matmul_gelu_grad_numpy(g, w_t, pre, sums=True):
    """NumPy twin of `matmul_gelu_grad`."""
    d = gelus.gelu_backward_numpy(pre.astype(compute_dtype(g.dtype)), _product(g, w_t))
    return d.astype(g.dtype), (d.sum(axis=0).astype(g.dtype) if sums else None)


def matmul_bias_grad_numpy(x_t, g, out_dtype):
    """NumPy twin of `matmul_bias_grad`."""
    return (gemm.matmul_numpy(x_t, g, out_dtype),
            column_sums.column_sum_numpy(g, dtype=out_dtype))
