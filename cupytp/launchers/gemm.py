"""Matrix products through cuBLAS (`cublasGemmEx`, `cublasGemmStridedBatchedEx`): through CuPy's
bindings, and called directly (ctypes) while a stream is being captured into a CUDA graph, where
CuPy's bindings refuse to run. A `Product` holds one product's arguments, worked out once.

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

_kept = []      # the host scalars whose addresses `_scalars` hands out
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
    lib.cublasGemmEx.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


@functools.cache
def _scalars(dtype):
    """(address of alpha, address of beta, compute type) for `dtype`: host scalars that live
    as long as the process (kept by this cache)."""
    if dtype == numpy.float64:
        one, zero, compute = numpy.ones(1), numpy.zeros(1), _COMPUTE_64F
    else:
        tf32 = dtype == numpy.float32 and os.environ.get("CUPY_TF32", "0") == "1"
        one, zero = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.float32)
        compute = _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F
    _kept.extend((one, zero))
    return one.ctypes.data, zero.ctypes.data, compute


def _transposed(x):
    """False for a C-contiguous x, True for a transposed C-contiguous array (the last two axes
    swapped), which cuBLAS reads in place; None for anything else."""
    if x.flags.c_contiguous:
        return False
    return True if backend.xp.swapaxes(x, -1, -2).flags.c_contiguous else None


def matmul(a, b, out_dtype=None, shape=None):
    """a @ b, written as `out_dtype` (see the module docstring). `shape`: the result's shape when
    it is to be a reshape of (..., M, N) (same elements in the same order), made with that shape
    rather than as a view of another array (so nothing else holds its memory)."""
    out_dtype, shape = _checked(a, b, out_dtype, shape)
    if not is_device_array(a):
        return matmul_numpy(a, b, out_dtype).reshape(shape)
    xp = backend.xp
    if not math.prod(shape):
        return xp.empty(shape, dtype=out_dtype)
    if a.shape[-1] == 0:
        return xp.zeros(shape, dtype=out_dtype)
    a_t, b_t = _transposed(a), _transposed(b)
    if a_t is None:
        a, a_t = xp.ascontiguousarray(a), False
    if b_t is None:
        b, b_t = xp.ascontiguousarray(b), False
    return Product(a, b, a_t, b_t, out_dtype, shape).run(a.data.ptr, b.data.ptr)


def product(a, b, out_dtype=None, shape=None):
    """The `Product` that computes `matmul(a, b, out_dtype, shape)` for any arrays of a's and
    b's shapes, strides and dtypes, reading them in place (from a.data.ptr and b.data.ptr), or
    None when it cannot: an operand that is neither contiguous nor a transposed contiguous
    array, an empty product or K = 0 (`matmul` handles those)."""
    out_dtype, shape = _checked(a, b, out_dtype, shape)
    if not math.prod(shape) or a.shape[-1] == 0:
        return None
    a_t, b_t = _transposed(a), _transposed(b)
    if a_t is None or b_t is None:
        return None
    return Product(a, b, a_t, b_t, out_dtype, shape)


def _checked(a, b, out_dtype, shape):
    """(output dtype, output shape) of a @ b after checking the operands."""
    out_dtype = _out_dtype(a.dtype, b.dtype, out_dtype)
    if a.shape[-1] != b.shape[-2] or (b.ndim > 2 and b.shape[:-2] != a.shape[:-2]):
        raise ValueError(f"gemm.matmul: shapes {a.shape} and {b.shape} do not multiply")
    m, n = a.shape[-2], b.shape[-1]
    count = math.prod(a.shape[:-2])
    shape = a.shape[:-2] + (m, n) if shape is None else tuple(shape)
    if math.prod(shape) != count * m * n:
        raise ValueError(f"gemm.matmul: the product of {a.shape} and {b.shape} has "
                         f"{count * m * n} elements, not the {math.prod(shape)} of shape {shape}")
    return out_dtype, shape


class Product:
    """One cuBLAS product with its arguments worked out once: `run(a_ptr, b_ptr)` multiplies
    the row-major operands at those addresses (a transposed when `a_t`, i.e. its memory holds
    aᵀ contiguously; b likewise) into a new array of `shape` and `out_dtype`. A product with a
    2-D b folds a's batch into M: one plain GEMM."""
    __slots__ = ("shape", "out_dtype", "batched", "head", "middle", "tail")

    def __init__(self, a, b, a_t, b_t, out_dtype, shape):
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        count = math.prod(a.shape[:-2])
        if b.ndim == 2 and not a_t:
            m, count = m * count, 1
        # row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ: cuBLAS gets B first
        lda, ldb = (k if b_t else n), (m if a_t else k)
        kind = _TYPES[a.dtype]
        alpha, beta, compute = _scalars(a.dtype)
        self.shape, self.out_dtype, self.batched = shape, out_dtype, count > 1
        self.head = (_OP_T if b_t else _OP_N, _OP_T if a_t else _OP_N, n, m, k, alpha)
        if self.batched:
            self.middle = ((kind, lda, 0 if b.ndim == 2 else k * n), (kind, ldb, m * k), beta)
            self.tail = (_TYPES[out_dtype], n, m * n, count, compute, _GEMM_DEFAULT)
        else:
            self.middle = ((kind, lda), (kind, ldb), beta)
            self.tail = (_TYPES[out_dtype], n, compute, _GEMM_DEFAULT)

    def run(self, a_ptr, b_ptr):
        out = backend.xp.empty(self.shape, dtype=self.out_dtype)
        b_args, a_args, beta = self.middle
        args = self.head + (b_ptr,) + b_args + (a_ptr,) + a_args + (beta, out.data.ptr) + \
            self.tail
        handle = backend.xp.cuda.device.get_cublas_handle()
        try:        # CuPy's binding (the cheaper call) refuses to run inside a stream capture
            (_cupy_cublas().gemmStridedBatchedEx if self.batched else _cupy_cublas().gemmEx)(
                handle, *args)
        except NotImplementedError:
            lib = _cublas()
            _check(lib.cublasSetStream_v2(handle, backend.xp.cuda.get_current_stream().ptr))
            _check((lib.cublasGemmStridedBatchedEx if self.batched else lib.cublasGemmEx)(
                handle, *args))
        return out


@functools.cache
def _cupy_cublas():
    from cupy_backends.cuda.libs import cublas
    return cublas


def _check(status):
    if status != 0:
        raise RuntimeError(f"cuBLAS call failed with status {status}")
