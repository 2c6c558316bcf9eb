"""Launchers of the hand-written CUDA kernels, each with a NumPy twin of the same math.

The CUDA sources live in the repository's top-level `kernels/` folder (shipped inside wheels as
`cupytp/_kernels/`), one op per `.cu` file; each has a thin launcher module here: CuPy arrays go to
the kernel, NumPy arrays to the twin. `gemm` and `cudnn_attention` launch cuBLAS and cuDNN. A
kernel is instantiated per dtype by a macro, named with the dtype's suffix (`gelu_forward_bf16`).
CuPy is touched only when a kernel is compiled, so the package imports on machines without a GPU.
Block reductions (`block_reduce.cuh`) are CUB's, from the CCCL headers CuPy bundles; kernels that
use them run with BLOCK_THREADS threads per block.
"""
import functools
import hashlib
from pathlib import Path

import numpy

from cupytp.backend import bfloat16, c_contiguous, on_gpu, xp

BLOCK_THREADS = 256  # threads per block of every kernel that calls block_reduce
_SUFFIXES = {
    numpy.dtype(numpy.float32): "f32",
    numpy.dtype(numpy.float64): "f64",
    bfloat16: "bf16",
    numpy.dtype(numpy.float16): "f16",
}


def ceil_div(a, b):
    """The smallest integer >= a / b (elementwise for NumPy integer arrays)."""
    return (a + b - 1) // b


def dtype_suffix(dtype):
    """The suffix naming a kernel's instantiation for a dtype: 'f32', 'f64', 'bf16' or 'f16'."""
    dtype = numpy.dtype(dtype)
    if dtype not in _SUFFIXES:
        raise ValueError(f"no kernel for dtype {dtype}: use float32, float64, bfloat16 or float16")
    return _SUFFIXES[dtype]


def has_kernel(dtype):
    """True for the dtypes kernels are instantiated for (float32, float64, bfloat16, float16)."""
    return numpy.dtype(dtype) in _SUFFIXES


def compute_dtype(dtype):
    """The dtype a kernel computes in: float64 for float64, float32 for float32/bfloat16/float16."""
    wide = dtype_suffix(dtype) == "f64"
    return numpy.dtype(numpy.float64 if wide else numpy.float32)


def is_device_array(array):
    """True for a CuPy array (always False on the NumPy backend)."""
    return on_gpu and isinstance(array, xp.ndarray)


@functools.cache
def multiprocessors():
    """The number of streaming multiprocessors of the current GPU."""
    return xp.cuda.Device().attributes["MultiProcessorCount"]


def lasting_buffer(nbytes):
    """A device buffer of `nbytes` for the rest of the process (a library's workspace): from the
    framework's default memory pool even while a CUDA graph's private pool is in use, so that it
    holds no graph's memory; the caller keeps the array."""
    import contextlib
    from cupytp import memory
    pool = memory.default_pool()
    with contextlib.nullcontext() if pool is None else memory.use_pool(pool):
        return xp.empty(max(nbytes, 1), dtype=numpy.uint8)


def vector_width(width, cols, arrays):
    """`width` when every row start of the [rows, cols] row-major `arrays` is aligned for vectors
    of `width` elements (cols a multiple of it, each base address of its vector size), else 1."""
    if cols % width:
        return 1
    for array in arrays:
        if array.data.ptr % (width * array.itemsize):
            return 1
    return width


def rows_grid(rows, vectors, threads=256, rows_per_thread=1, max_row_blocks=65535):
    """(grid, block) of a kernel whose thread (x, y) owns one vector of columns and strides over
    rows: blocks of `threads`, `vectors` per row across x (a multiple of 32 lanes, at most
    `threads`; half of `threads` where that leaves fewer lanes past the row's end, as 128 lanes
    do for GPT-2's 384 vectors of 3072 bf16 columns), the rest of the block and grid across
    rows, about `rows_per_thread` rows each (at most `max_row_blocks` blocks across rows: then
    more)."""
    lanes = min(threads, ceil_div(vectors, 32) * 32)
    half = threads // 2
    if lanes == threads and half >= 32 and ceil_div(vectors, half) * half < \
            ceil_div(vectors, threads) * threads:
        lanes = half
    row_lanes = threads // lanes
    row_blocks = ceil_div(rows, row_lanes * rows_per_thread)
    return ((ceil_div(vectors, lanes), max(1, min(row_blocks, max_row_blocks))),
            (lanes, row_lanes))


def nullable(array, dtype):
    """A kernel's optional pointer argument: `array` (a device array of `dtype`, one element or
    more) or a null pointer for None."""
    if array is None:
        return numpy.uint64(0)
    if array.dtype != dtype:
        raise ValueError(f"expected a {numpy.dtype(dtype)} array, got {array.dtype}")
    return array


def check_lists(**lists):
    """Validate parallel lists of arrays for one op; return {name: dtype of the list}.

    The lists must have one length, the i-th arrays of all lists one shape, every array must be
    C-contiguous and of one array type (NumPy or CuPy), and each list must hold a single dtype.
    Empty lists give {}.
    """
    if len(lists) == 1:             # one array, as most launchers check: nothing to compare
        (name, arrays), = lists.items()
        if len(arrays) == 1:
            if not c_contiguous(arrays[0]):
                raise ValueError(f"{name}[0] is not C-contiguous")
            return {name: arrays[0].dtype}
    names = list(lists)
    first = lists[names[0]]
    for name, arrays in lists.items():
        if len(arrays) != len(first):
            raise ValueError(f"{name} has {len(arrays)} arrays but {names[0]} has {len(first)}")
    if not first:
        return {}
    kind = type(first[0])
    dtypes = {}
    for name, arrays in lists.items():
        dtype = dtypes[name] = arrays[0].dtype
        for array, reference in zip(arrays, first):      # one test per array; why, if it fails
            if not (type(array) is kind and array.dtype == dtype
                    and array.shape == reference.shape and c_contiguous(array)):
                _list_error(names[0], first, name, arrays)
    return dtypes


def _list_error(first_name, first, name, arrays):
    """Raise the error that `check_lists` found in `arrays` (the list `name`)."""
    kind = type(first[0])
    for i, (array, reference) in enumerate(zip(arrays, first)):
        if type(array) is not kind:
            raise ValueError(f"{name}[{i}] is a {type(array).__name__} but {first_name}[0] is a "
                             f"{kind.__name__}: NumPy and CuPy arrays cannot be mixed")
        if array.dtype != arrays[0].dtype:
            raise ValueError(f"{name}[{i}] has dtype {array.dtype} but {name}[0] has "
                             f"{arrays[0].dtype}: each list must hold one dtype")
        if array.shape != reference.shape:
            raise ValueError(f"{name}[{i}] has shape {array.shape} but {first_name}[{i}] has "
                             f"shape {reference.shape}")
        if not c_contiguous(array):
            raise ValueError(f"{name}[{i}] is not C-contiguous")


@functools.cache
def _cccl_includes():
    """-I options for the CUB, Thrust and libcu++ headers bundled with CuPy."""
    root = Path(xp.__file__).parent / "_core" / "include" / "cupy" / "_cccl"
    if not (root / "cub").is_dir():
        raise RuntimeError(f"CuPy {xp.__version__} has no bundled CUB headers under {root}: the "
                           "kernels' block reductions need them; install CuPy 14 or newer")
    return tuple(f"-I{root / name}" for name in ("cub", "thrust", "libcudacxx"))


def sources():
    """The folder of the CUDA sources: `kernels/` of a source checkout or editable install, else
    the copy a wheel installs as `cupytp/_kernels/`."""
    package = Path(__file__).resolve().parent.parent
    for folder in (package.parent / "kernels", package / "_kernels"):
        if (folder / "common.cuh").is_file():
            return folder
    raise RuntimeError(f"the CUDA sources of cupytp are missing: neither {package.parent} / "
                       f"kernels nor {package} / _kernels holds them; reinstall cupytp")


def _source_options(folder):
    """The options every kernel of `folder` compiles with: its headers' folder, the block size,
    and a digest of those headers. CuPy's cache of compiled kernels keys on a source's own text
    and its options, not on what it includes, so without the digest a changed `.cuh` would go on
    running the kernels built from the old one."""
    digest = hashlib.sha1()
    for header in sorted(Path(folder).glob("*.cuh")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes() + b"\0")
    return (f"-I{folder}", f"-DCUPYTP_BLOCK_THREADS={BLOCK_THREADS}",
            f"-DCUPYTP_HEADERS={digest.hexdigest()[:16]}")


@functools.cache
def _module(cu_file, options):
    folder = sources()
    options += _source_options(folder) + _cccl_includes()
    return xp.RawModule(code=(folder / cu_file).read_text(), options=options)


@functools.cache
def _function(cu_file, name, options):
    from cupytp.launchers.kernel import Kernel
    return Kernel(_module(cu_file, options).get_function(name), xp)


def get_kernel(cu_file, name, options=()):
    """The kernel `name` of `kernels/<cu_file>` (a `kernel.Kernel`, launched through the
    driver); each (file, options) compiles once."""
    if not on_gpu:
        raise RuntimeError(f"kernel {name} of {cu_file} needs the CuPy backend, but it is NumPy")
    return _function(cu_file, name, tuple(options))
