"""bfloat16 matrix products: cuBLAS (gemmStridedBatchedEx, fp32 accumulation) on GPU, and the
NumPy twin of the same math (bf16 inputs, fp32 products and sums, one rounding to bf16).

`matmul(a, b)`: a (..., M, K), b (K, N) or (..., K, N) with the same batch dims; either may be
a transposed view of a C-contiguous array (the last two axes swapped), which cuBLAS reads in
place through its op flags.
"""
import numpy

from cupytp import backend
from cupytp.kernels import is_device_array

_CUDA_R_16BF, _CUBLAS_COMPUTE_32F, _GEMM_DEFAULT = 14, 68, -1
_OP_N, _OP_T = 0, 1


def matmul_numpy(a, b):
    return numpy.matmul(a.astype(numpy.float32), b.astype(numpy.float32)).astype(a.dtype)


def _operand(x):
    """(array with C-contiguous memory, transposed?) for one operand."""
    xp = backend.xp
    if x.flags.c_contiguous:
        return x, False
    swapped = xp.swapaxes(x, -1, -2)
    if swapped.flags.c_contiguous:
        return swapped, True
    return xp.ascontiguousarray(x), False


def matmul(a, b):
    """a @ b for bfloat16 arrays (see the module docstring)."""
    if a.dtype != backend.bfloat16 or b.dtype != backend.bfloat16:
        raise ValueError(f"gemm.matmul takes bfloat16 operands, got {a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[-2] or (b.ndim > 2 and b.shape[:-2] != a.shape[:-2]):
        raise ValueError(f"gemm.matmul: shapes {a.shape} and {b.shape} do not multiply")
    if not is_device_array(a):
        return matmul_numpy(a, b)
    from cupy_backends.cuda.libs import cublas
    xp = backend.xp
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = a.shape[:-2]
    count = int(numpy.prod(batch, dtype=numpy.int64))
    out = xp.empty(batch + (m, n), dtype=a.dtype)
    a_mem, a_t = _operand(a)
    b_mem, b_t = _operand(b)
    if b.ndim == 2 and not a_t:           # fold the batch into M: one plain GEMM
        m, count = m * count, 1
    # row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ: cuBLAS gets B first
    lda = k if b_t else n
    ldb = m if a_t else k
    alpha, beta = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.float32)
    handle = xp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, xp.cuda.get_current_stream().ptr)
    cublas.gemmStridedBatchedEx(
        handle, _OP_T if b_t else _OP_N, _OP_T if a_t else _OP_N, n, m, k,
        alpha.ctypes.data, b_mem.data.ptr, _CUDA_R_16BF, lda, 0 if b.ndim == 2 else k * n,
        a_mem.data.ptr, _CUDA_R_16BF, ldb, m * k,
        beta.ctypes.data, out.data.ptr, _CUDA_R_16BF, n, m * n, count,
        _CUBLAS_COMPUTE_32F, _GEMM_DEFAULT)
    return out
