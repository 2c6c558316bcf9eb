"""Matrix products through cuBLAS (`cublasGemmStridedBatchedEx`), called directly rather than
through CuPy's wrappers, which refuse to run while a stream is being captured into a CUDA graph.

`matmul(a, b)`: a (..., M, K), b (K, N) or (..., K, N) with the same batch dims, one float dtype
(float64, float32, bfloat16 or float16); either may be a transposed view of a C-contiguous array
(the last two axes swapped), which cuBLAS reads in place through its op flags. Accumulation is in
float32 (float64 for float64); float32 products use TF32 tensor cores when CUPY_TF32=1, as CuPy's
own matmul does. The NumPy twin is the same math: for 16-bit inputs, float32 products and sums
rounded once to the input dtype; otherwise numpy.matmul.
"""
import ctypes
import functools
import math
import os

import numpy

from cupytp import backend
from cupytp.launchers import is_device_array

# cudaDataType, cublasComputeType_t, cublasOperation_t, cublasGemmAlgo_t
_CUDA_R_32F, _CUDA_R_64F, _CUDA_R_16F, _CUDA_R_16BF = 0, 1, 2, 14
_COMPUTE_32F, _COMPUTE_64F, _COMPUTE_32F_FAST_TF32 = 68, 70, 74
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1

_TYPES = {numpy.dtype(numpy.float32): _CUDA_R_32F, numpy.dtype(numpy.float64): _CUDA_R_64F,
          numpy.dtype(numpy.float16): _CUDA_R_16F, backend.bfloat16: _CUDA_R_16BF}


def matmul_numpy(a, b, out_dtype=None):
    """NumPy twin: float32 math for 16-bit inputs (one rounding at the end, to `out_dtype`,
    default the inputs' dtype), else numpy.matmul."""
    out_dtype = _out_dtype(a.dtype, b.dtype, out_dtype)
    if a.dtype.itemsize < 4:
        return numpy.matmul(a.astype(numpy.float32), b.astype(numpy.float32)).astype(out_dtype)
    return numpy.matmul(a, b)


def _out_dtype(a_dtype, b_dtype, out_dtype):
    """The output dtype of a product: the operands' one float dtype, or float32 from 16-bit ones."""
    if a_dtype != b_dtype or a_dtype not in _TYPES:
        raise ValueError(f"gemm.matmul takes two operands of one float dtype, got {a_dtype} and "
                         f"{b_dtype}")
    out_dtype = a_dtype if out_dtype is None else numpy.dtype(out_dtype)
    if out_dtype != a_dtype and not (out_dtype == numpy.float32 and a_dtype.itemsize == 2):
        raise ValueError(f"gemm.matmul writes {a_dtype} operands' product as {a_dtype}"
                         f"{' or float32' if a_dtype.itemsize == 2 else ''}, not {out_dtype}")
    return out_dtype


@functools.cache
def _cublas():
    """libcublas as CuPy loaded it (found in this process's memory map), with the two entry
    points typed."""
    backend.xp.cuda.device.get_cublas_handle()          # makes CuPy load the library
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublas.so" in line
                 and "libcublasLt" not in line}
    if not paths:
        raise RuntimeError("cuBLAS is not loaded in this process: cannot find libcublas")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cublasGemmStridedBatchedEx.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
        ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


@functools.cache
def _scalars(dtype):
    """(alpha, beta, compute type) for `dtype`; alpha and beta live as long as the process."""
    if dtype == numpy.float64:
        one, zero, compute = numpy.ones(1), numpy.zeros(1), _COMPUTE_64F
    else:
        tf32 = dtype == numpy.float32 and os.environ.get("CUPY_TF32", "0") == "1"
        one, zero = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.float32)
        compute = _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F
    return one, zero, compute


def _operand(x):
    """(array with C-contiguous memory, transposed?) for one operand."""
    xp = backend.xp
    if x.flags.c_contiguous:
        return x, False
    swapped = xp.swapaxes(x, -1, -2)
    if swapped.flags.c_contiguous:
        return swapped, True
    return xp.ascontiguousarray(x), False


def matmul(a, b, out_dtype=None, shape=None):
    """a @ b, written as `out_dtype` (see the module docstring). `shape`: the result's shape when
    it is to be a reshape of (..., M, N) (same elements in the same order), made with that shape
    rather than as a view of another array (so nothing else holds its memory)."""
    out_dtype = _out_dtype(a.dtype, b.dtype, out_dtype)
    if a.shape[-1] != b.shape[-2] or (b.ndim > 2 and b.shape[:-2] != a.shape[:-2]):
        raise ValueError(f"gemm.matmul: shapes {a.shape} and {b.shape} do not multiply")
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = a.shape[:-2]
    count = math.prod(batch)
    shape = batch + (m, n) if shape is None else tuple(shape)
    if math.prod(shape) != count * m * n:
        raise ValueError(f"gemm.matmul: the product of {a.shape} and {b.shape} has "
                         f"{count * m * n} elements, not the {math.prod(shape)} of shape {shape}")
    if not is_device_array(a):
        return matmul_numpy(a, b, out_dtype).reshape(shape)
    xp = backend.xp
    out = xp.empty(shape, dtype=out_dtype)
    if out.size == 0:
        return out
    if k == 0:
        out[...] = 0
        return out
    a_mem, a_t = _operand(a)
    b_mem, b_t = _operand(b)
    if b.ndim == 2 and not a_t:           # fold the batch into M: one plain GEMM
        m, count = m * count, 1
    # row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ: cuBLAS gets B first
    lda = k if b_t else n
    ldb = m if a_t else k
    kind = _TYPES[a.dtype]
    alpha, beta, compute = _scalars(a.dtype)
    lib = _cublas()
    handle = xp.cuda.device.get_cublas_handle()
    _check(lib.cublasSetStream_v2(handle, xp.cuda.get_current_stream().ptr))
    _check(lib.cublasGemmStridedBatchedEx(
        handle, _OP_T if b_t else _OP_N, _OP_T if a_t else _OP_N, n, m, k,
        alpha.ctypes.data, b_mem.data.ptr, kind, lda, 0 if b.ndim == 2 else k * n,
        a_mem.data.ptr, kind, ldb, m * k,
        beta.ctypes.data, out.data.ptr, _TYPES[out_dtype], n, m * n, count, compute,
        _GEMM_DEFAULT))
    return out


def _check(status):
    if status != 0:
        raise RuntimeError(f"cuBLAS call failed with status {status}")
