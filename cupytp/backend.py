"""The array backend: CuPy on a usable GPU, NumPy otherwise.

`xp` is the array module every layer above computes with. The choice is made once, at import:
`CUPYTP_DEVICE=gpu` demands CuPy (an error if no GPU is usable), `CUPYTP_DEVICE=cpu` forces NumPy,
and with the variable unset CuPy is taken when it imports and sees at least one device.
bfloat16 comes from ml_dtypes on both backends.
"""
import ml_dtypes
import numpy

from cupytp import env

bfloat16 = numpy.dtype(ml_dtypes.bfloat16)

DTYPES = {
    "bf16": bfloat16, "bfloat16": bfloat16,
    "fp16": numpy.dtype(numpy.float16), "float16": numpy.dtype(numpy.float16),
    "fp32": numpy.dtype(numpy.float32), "float32": numpy.dtype(numpy.float32),
    "fp64": numpy.dtype(numpy.float64), "float64": numpy.dtype(numpy.float64),
    "int32": numpy.dtype(numpy.int32), "int64": numpy.dtype(numpy.int64),
    "uint8": numpy.dtype(numpy.uint8),
}


class BackendError(RuntimeError):
    """The requested array backend cannot be used on this machine."""


def _usable_cupy():
    """CuPy if it imports and sees a device, else the reason it cannot be used."""
    try:
        import cupy
    except ImportError as err:
        return None, f"CuPy is not installed ({err}); install cupytp[cuda13] or cupytp[cuda12]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # the CUDA driver raises its own error types
        return None, f"CUDA is not usable: {err}"
    if count == 0:
        return None, "CUDA reports no GPU"
    return cupy, None


def _select():
    wanted = env.get("CUPYTP_DEVICE")
    if wanted == "cpu":
        return numpy
    cupy, why = _usable_cupy()
    if cupy is not None:
        return cupy
    if wanted == "gpu":
        raise BackendError(f"CUPYTP_DEVICE=gpu, but {why}; unset it or use CUPYTP_DEVICE=cpu")
    return numpy


xp = _select()
on_gpu = xp is not numpy
device_name = "gpu" if on_gpu else "cpu"


def dtype(name_or_dtype):
    """A numpy dtype from a short name ('bf16', 'fp32', ...) or anything numpy.dtype accepts."""
    if isinstance(name_or_dtype, str) and name_or_dtype in DTYPES:
        return DTYPES[name_or_dtype]
    return numpy.dtype(name_or_dtype)


def c_contiguous(array):
    """`array.flags.c_contiguous`; a CuPy array's is read from its attribute, without making the
    flags object (five times the cost, on the host path of every launch)."""
    if on_gpu and type(array) is xp.ndarray:
        return array._c_contiguous
    return array.flags.c_contiguous


def array_module(array):
    """The module of `array`'s kind: CuPy for a device array, else NumPy (NumPy twins run on
    host arrays on a GPU machine too)."""
    return xp if on_gpu and isinstance(array, xp.ndarray) else numpy


def asnumpy(array):
    """A host (NumPy) copy of an array from either backend."""
    if on_gpu and isinstance(array, xp.ndarray):
        return xp.asnumpy(array)
    return numpy.asarray(array)


def asarray(array, dtype=None):
    """The array on the backend's device (a copy only where needed)."""
    return xp.asarray(array, dtype=dtype)


def copy_rows(dst, src):
    """`dst[...] = src` for 2-D arrays of one dtype whose rows are contiguous (any row pitch):
    one cudaMemcpy2DAsync on the current stream on a GPU, which moves strided rows at copy
    bandwidth where an elementwise copy kernel indexes every element."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.ndim != 2:
        raise ValueError(f"copy_rows: {dst.shape} {dst.dtype} from {src.shape} {src.dtype}")
    if not on_gpu or dst.size == 0:
        dst[...] = src
        return
    item = dst.itemsize
    if dst.strides[1] != item or src.strides[1] != item:
        raise ValueError("copy_rows: the rows must be contiguous")
    runtime = xp.cuda.runtime
    runtime.memcpy2DAsync(dst.data.ptr, dst.strides[0], src.data.ptr, src.strides[0],
                          dst.shape[1] * item, dst.shape[0], runtime.memcpyDeviceToDevice,
                          xp.cuda.get_current_stream().ptr)


def synchronize():
    """Wait until the current stream's work is done (a no-op on CPU).

    Polls an event, sleeping between polls, so other Python threads (the collective watchdog)
    keep running while this one waits."""
    if on_gpu:
        import time
        event = xp.cuda.get_current_stream().record()
        delay = 1e-6
        while not event.done:
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
