"""Matrix products through cuBLASLt (`cublasLtMatmul`, called through ctypes): a `Product` holds
one product's descriptors and its algorithm (the fastest of cuBLASLt's candidates, timed at its
first run: `gemm_choice`), worked out once, so that a call is one C call with nothing to decide
(cuBLAS's `cublasGemmEx` decides again on every call, which costs a small product more host time
than its device time). A workspace of WORKSPACE_BYTES per stream lives as long as the process.
Where cuBLASLt offers no algorithm, or with CUPYTP_CUBLASLT=0, the product runs through
`cublasGemmEx` / `cublasGemmStridedBatchedEx`: CuPy's bindings, or the library called directly
while a stream is being captured into a CUDA graph, where CuPy's bindings refuse to run.

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

from cupytp import backend, env
from cupytp.launchers import gemm_choice, is_device_array, lasting_buffer

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
    out_dtype = product_dtype(a.dtype, b.dtype, out_dtype)
    if a.dtype.itemsize < 4:
        return numpy.matmul(a.astype(numpy.float32), b.astype(numpy.float32)).astype(out_dtype)
    return numpy.matmul(a, b)


def product_dtype(a_dtype, b_dtype, out_dtype):
    """The output dtype of a product: the operands' one float dtype, or float32 from 16-bit ones."""
    if a_dtype != b_dtype or a_dtype not in _TYPES:
        raise ValueError(f"gemm.matmul takes two operands of one float dtype, got {a_dtype} and "
                         f"{b_dtype}")
    out_dtype = a_dtype if out_dtype is None else numpy.dtype(out_dtype)
    if out_dtype != a_dtype and not (out_dtype == numpy.float32 and a_dtype.itemsize == 2):
        raise ValueError(f"gemm.matmul writes {a_dtype} operands' product as {a_dtype}"
                         f"{' or float32' if a_dtype.itemsize == 2 else ''}, not {out_dtype}")
    return out_dtype


def _loaded_library(name):
    """The shared library `name` (e.g. 'libcublas.so') as this process loaded it, found in its
    memory map (CuPy loads cuBLAS, which loads cuBLASLt)."""
    backend.xp.cuda.device.get_cublas_handle()          # makes CuPy load the libraries
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps
                 if os.path.basename(line.split()[-1]).startswith(name)}
    if not paths:
        raise RuntimeError(f"{name} is not loaded in this process: cannot call it")
    return ctypes.CDLL(sorted(paths)[0])


@functools.cache
def _cublas():
    """libcublas with the two entry points typed."""
    lib = _loaded_library("libcublas.so")
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


# ---- cuBLASLt -----------------------------------------------------------------------------------
# attributes of cublasLt.h: matmul descriptor, matrix layout, preference
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_AUX_POINTER, _DESC_AUX_LD = 7, 8, 11, 12
_LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 5, 6
_PREF_MAX_WORKSPACE_BYTES = 1
_HEURISTIC_RESULT_BYTES = 96    # cublasLtMatmulHeuristicResult_t: the algorithm's 64 bytes first
_ALGO_STATE_OFFSET = 72         # ... then size_t workspaceSize, cublasStatus_t state
LT_ALIGNMENT = 256              # the operand alignment the chosen algorithms may assume
EPILOGUE_DESCRIPTORS = 64       # matmul descriptors an epilogue plan keeps, one per bias pointer
WORKSPACE_BYTES = 32 * 2 ** 20
MATMULS_KEPT = 4096              # products `matmul` keeps, the oldest dropped past that
_matmuls = {}                   # matmul's signature -> its Product, made at its first call
_workspaces = {}                # stream pointer -> the address of that stream's workspace
_workspace_arrays = []          # ... kept for the life of the process


def use_cublaslt():
    """CUPYTP_CUBLASLT: '1' (the default: products through cuBLASLt) or '0' (cublasGemmEx)."""
    return env.get("CUPYTP_CUBLASLT")


class _Lt:
    """libcublasLt with its entry points typed, one handle and one heuristic preference (at most
    WORKSPACE_BYTES of workspace)."""

    def __init__(self):
        lib = _loaded_library("libcublasLt.so")
        p, i32, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(p)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(p), i32, i32]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [p, i32, p, ctypes.c_size_t]
        lib.cublasLtMatmulDescDestroy.argtypes = [p]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(p), i32, u64, u64,
                                                   ctypes.c_int64]
        lib.cublasLtMatrixLayoutSetAttribute.argtypes = [p, i32, p, ctypes.c_size_t]
        lib.cublasLtMatrixLayoutDestroy.argtypes = [p]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(p)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [p, i32, p, ctypes.c_size_t]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [p, p, p, p, p, p, p, i32, p,
                                                       ctypes.POINTER(i32)]
        lib.cublasLtMatmul.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, p, p, ctypes.c_size_t,
                                       p]
        self.lib, self.matmul = lib, lib.cublasLtMatmul
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = lib.cublasLtGetVersion()
        props = backend.xp.cuda.runtime.getDeviceProperties(backend.xp.cuda.Device().id)
        self.device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        self.handle = self._made(lib.cublasLtCreate)
        self.preference = self._made(lib.cublasLtMatmulPreferenceCreate)
        self._set(lib.cublasLtMatmulPreferenceSetAttribute, self.preference,
                  _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES))

    @staticmethod
    def _made(create, *args):
        out = ctypes.c_void_p()
        _check(create(ctypes.byref(out), *args))
        return out.value

    @staticmethod
    def _set(setter, target, attribute, value):
        _check(setter(target, attribute, ctypes.byref(value), ctypes.sizeof(value)))

    def layout(self, kind, rows, cols, ld, count, stride):
        """A column-major matrix layout: `count` matrices `stride` elements apart."""
        layout = self._made(self.lib.cublasLtMatrixLayoutCreate, kind, rows, cols, ld)
        if count > 1:
            setter = self.lib.cublasLtMatrixLayoutSetAttribute
            self._set(setter, layout, _LAYOUT_BATCH_COUNT, ctypes.c_int32(count))
            self._set(setter, layout, _LAYOUT_BATCH_STRIDE, ctypes.c_int64(stride))
        return layout


@functools.cache
def _lt():
    return _Lt()


class _LtPlan:
    """One cuBLASLt product, column-major as cuBLAS sees it: D (rows x cols) = op(first)
    op(second), its descriptors and its algorithm (`args` None: the heuristic offered none): the
    heuristic's first, or the fastest of its candidates (`gemm_choice`), known from the choices
    file or timed at the plan's first run outside a capture (`pending` holds the product's key
    until then).
    `epilogue`: (cublasLtEpilogue_t, the auxiliary matrix's leading dimension or None) for a
    product with a fused epilogue (`gemm_epilogue`), whose bias and auxiliary pointers `run`
    passes. Those pointers are attributes of the matmul descriptor, and setting one costs about
    as much host time as a launch, so such a plan keeps a descriptor per bias pointer (at most
    EPILOGUE_DESCRIPTORS, the oldest dropped): one plan serves every layer of a shape, and each
    layer's bias (a parameter, or its gradient, which the pool gives the same address step after
    step) finds its descriptor with its pointers already set."""
    __slots__ = ("args", "descriptors", "recipe", "by_bias", "candidates", "pending",
                 "__weakref__")

    def __init__(self, ops, rows, cols, k, first, second, out, count, compute, scalars,
                 epilogue=None):
        lt, (alpha, beta) = _lt(), scalars
        self.args = self.descriptors = None
        self.recipe = (compute, ops, epilogue)
        self.by_bias = {}           # bias pointer -> [its matmul descriptor, aux pointer set]
        desc = self._descriptor()
        stored_first = (k, rows) if ops[0] == _OP_T else (rows, k)
        stored_second = (cols, k) if ops[1] == _OP_T else (k, cols)
        layouts = [lt.layout(kind, *stored, ld, count, stride) for stored, (kind, ld, stride)
                   in ((stored_first, first), (stored_second, second), ((rows, cols), out))]
        self.descriptors = (lt.lib, desc, layouts)
        tune = gemm_choice.tuning()
        asked = gemm_choice.CANDIDATES if tune else 1
        result, found = ctypes.create_string_buffer(_HEURISTIC_RESULT_BYTES * asked), \
            ctypes.c_int32(0)
        _check(lt.lib.cublasLtMatmulAlgoGetHeuristic(
            lt.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], lt.preference, asked,
            result, ctypes.byref(found)))
        self.candidates = [ctypes.addressof(result) + i * _HEURISTIC_RESULT_BYTES
                           for i in range(found.value) if not _state(result, i)]
        self.pending = None
        if not self.candidates:
            return
        index = 0
        if tune and len(self.candidates) > 1 and \
                count * rows * cols * k >= gemm_choice.TUNED_FROM:
            key = _lt_key(lt, (rows, cols, k, first, second, out, count, beta == alpha),
                          self.recipe)
            index = gemm_choice.choices().get(key)
            if index is None or index >= len(self.candidates):
                index, self.pending = 0, key
        self.args = (lt.matmul, lt.handle, desc, alpha, layouts[0], layouts[1], beta,
                     layouts[2], self.candidates[index], result)

    def _descriptor(self, bias_ptr=0):
        """A new matmul descriptor of this plan's operations and epilogue (its bias pointer
        `bias_ptr` when not 0)."""
        lt, (compute, (op_first, op_second), epilogue) = _lt(), self.recipe
        scale = _CUDA_R_64F if compute == _COMPUTE_64F else _CUDA_R_32F
        desc = lt._made(lt.lib.cublasLtMatmulDescCreate, compute, scale)
        setter = lt.lib.cublasLtMatmulDescSetAttribute
        for attribute, op in ((_DESC_TRANSA, op_first), (_DESC_TRANSB, op_second)):
            lt._set(setter, desc, attribute, ctypes.c_int32(op))
        if epilogue is not None:
            lt._set(setter, desc, _DESC_EPILOGUE, ctypes.c_int32(epilogue[0]))
            if epilogue[1] is not None:
                lt._set(setter, desc, _DESC_AUX_LD, ctypes.c_int64(epilogue[1]))
        if bias_ptr:
            lt._set(setter, desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        return desc

    def _epilogue_descriptor(self, bias_ptr):
        """[descriptor, aux pointer set (0: none)] of `bias_ptr`, made on its first use."""
        by_bias = self.by_bias
        if len(by_bias) >= EPILOGUE_DESCRIPTORS:
            _lt().lib.cublasLtMatmulDescDestroy(by_bias.pop(next(iter(by_bias)))[0])
        entry = by_bias[bias_ptr] = [self._descriptor(bias_ptr), 0]
        return entry

    def run(self, first_ptr, second_ptr, out_ptr, c_ptr=None, bias_ptr=0, aux_ptr=0):
        """D = op(first) op(second) into out_ptr on the current stream (operands aligned to
        LT_ALIGNMENT bytes); with an epilogue, its bias vector at bias_ptr and auxiliary matrix
        at aux_ptr (0: none; an epilogue with an auxiliary matrix and no bias keeps its
        descriptor under bias pointer 0), and C (beta's matrix, of D's layout) at c_ptr
        (default D)."""
        matmul, handle, desc, alpha, first, second, beta, out, algo, _ = self.args
        if bias_ptr or aux_ptr:
            entry = self.by_bias.get(bias_ptr) or self._epilogue_descriptor(bias_ptr)
            desc = entry[0]
            if aux_ptr and entry[1] != aux_ptr:
                _check(self.descriptors[0].cublasLtMatmulDescSetAttribute(
                    desc, _DESC_AUX_POINTER, ctypes.byref(ctypes.c_void_p(aux_ptr)), 8))
                entry[1] = aux_ptr
        stream = backend.xp.cuda.get_current_stream().ptr
        workspace = _workspaces.get(stream) or _workspace(stream)
        c_ptr = out_ptr if c_ptr is None else c_ptr
        if self.pending is not None and not (beta == alpha and c_ptr == out_ptr):
            algo = self._tune(lambda candidate: _check(matmul(
                handle, desc, alpha, first_ptr, first, second_ptr, second, beta, c_ptr, out,
                out_ptr, out, candidate, workspace, WORKSPACE_BYTES, stream)))
        _check(matmul(handle, desc, alpha, first_ptr, first, second_ptr, second, beta, c_ptr,
                      out, out_ptr, out, algo, workspace, WORKSPACE_BYTES, stream))

    def _tune(self, run):
        """The algorithm the choices file has for this product (another process's), else that of
        the fastest candidate, timed on this run's operands and added to the file: each
        candidate writes the output (and an epilogue's outputs) that the run then writes again.
        `run` (which `run` does not call with C = D and beta 1: a timing would add the product
        to D again and again) runs a candidate's algorithm. Inside a capture, the heuristic's
        first, untimed and kept: a graph and the eager runs after it then run one algorithm."""
        key, self.pending = self.pending, None
        if backend.xp.cuda.get_current_stream().is_capturing():
            return self.args[8]
        book = gemm_choice.choices()
        index = book.lookup(key)        # another process's (another rank's), where it was first
        if index is None:
            index = gemm_choice.timed_from_memory(lambda timer: gemm_choice.fastest(
                lambda i: run(self.candidates[i]), len(self.candidates), timer))
            if index is None:
                return self.args[8]
            index = book.add(key, index)    # another process's, where it wrote one meanwhile
        self.use(index if index < len(self.candidates) else 0)
        return self.args[8]

    def use(self, index):
        """Run candidate `index` of the heuristic's list from now on (untimed)."""
        self.pending = None
        self.args = self.args[:8] + (self.candidates[index],) + self.args[9:]

    def __del__(self):
        if self.descriptors is not None:
            lib, desc, layouts = self.descriptors
            for descriptor in [desc] + [entry[0] for entry in self.by_bias.values()]:
                lib.cublasLtMatmulDescDestroy(descriptor)
            for layout in layouts:
                lib.cublasLtMatrixLayoutDestroy(layout)


def _state(results, index):
    """The cublasStatus_t of heuristic result `index` in the buffer `results` (0: usable)."""
    at = index * _HEURISTIC_RESULT_BYTES + _ALGO_STATE_OFFSET
    return int.from_bytes(results.raw[at:at + 4], "little")


def _lt_key(lt, shape, recipe):
    """The choices file's key of a product: the GPU, the cuBLASLt version, the product's sizes,
    operand types, leading dimensions and strides, whether it adds C, its compute type,
    operations and epilogue."""
    return f"{lt.device}|cublasLt {lt.version}|{shape}|{recipe}"


def _workspace(stream):
    """The cuBLASLt workspace of `stream`, made at its first product."""
    array = lasting_buffer(WORKSPACE_BYTES)
    _workspace_arrays.append(array)
    _workspaces[stream] = array.data.ptr
    return array.data.ptr


def transposed(x):
    """False for a C-contiguous x, True for a transposed C-contiguous array (the last two axes
    swapped), which cuBLAS reads in place; None for anything else."""
    if backend.c_contiguous(x):
        return False
    return True if backend.c_contiguous(backend.xp.swapaxes(x, -1, -2)) else None


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
    a_t, b_t = transposed(a), transposed(b)
    if a_t is None:
        a, a_t = xp.ascontiguousarray(a), False
    if b_t is None:
        b, b_t = xp.ascontiguousarray(b), False
    key = (a.shape, a_t, b.shape, b_t, a.dtype, out_dtype, shape)
    made = _matmuls.get(key)
    if made is None:
        if len(_matmuls) >= MATMULS_KEPT:       # a decoder's growing shapes: the oldest goes
            del _matmuls[next(iter(_matmuls))]
        made = _matmuls[key] = Product(a, b, a_t, b_t, out_dtype, shape)
    return made.run(a.data.ptr, b.data.ptr)


def product(a, b, out_dtype=None, shape=None):
    """The `Product` that computes `matmul(a, b, out_dtype, shape)` for any arrays of a's and
    b's shapes, strides and dtypes, reading them in place (from a.data.ptr and b.data.ptr), or
    None when it cannot: an operand that is neither contiguous nor a transposed contiguous
    array, an empty product or K = 0 (`matmul` handles those)."""
    out_dtype, shape = _checked(a, b, out_dtype, shape)
    if not math.prod(shape) or a.shape[-1] == 0:
        return None
    a_t, b_t = transposed(a), transposed(b)
    if a_t is None or b_t is None:
        return None
    return Product(a, b, a_t, b_t, out_dtype, shape)


def _checked(a, b, out_dtype, shape):
    """(output dtype, output shape) of a @ b after checking the operands."""
    out_dtype = product_dtype(a.dtype, b.dtype, out_dtype)
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
    2-D b folds a's batch into M: one plain GEMM. With `epilogue` (see `_LtPlan`; `plus_c`:
    D = a b + C) it is a cuBLASLt product only, `lt` None where cuBLASLt offers no algorithm."""
    __slots__ = ("shape", "out_dtype", "batched", "head", "middle", "tail", "lt")

    def __init__(self, a, b, a_t, b_t, out_dtype, shape, epilogue=None, plus_c=False):
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
        first = (kind, lda, 0 if b.ndim == 2 else k * n)
        second, out = (kind, ldb, m * k), (_TYPES[out_dtype], n, m * n)
        if self.batched:
            self.middle, self.tail = (first, second, beta), out + (count, compute, _GEMM_DEFAULT)
        else:
            self.middle = (first[:2], second[:2], beta)
            self.tail = out[:2] + (compute, _GEMM_DEFAULT)
        self.lt = None
        if is_device_array(a) and use_cublaslt():
            plan = _LtPlan(self.head[:2], n, m, k, first, second, out, count, compute,
                           (alpha, alpha if plus_c else beta), epilogue)
            self.lt = plan if plan.args is not None else None

    def run(self, a_ptr, b_ptr):
        out = backend.xp.empty(self.shape, dtype=self.out_dtype)
        if self.lt is not None and not (a_ptr | b_ptr) % LT_ALIGNMENT:
            self.lt.run(b_ptr, a_ptr, out.data.ptr)
            return out
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
