"""Rotary position embeddings (Hugging Face's rotate-half form): `rotary.cu` for CuPy arrays, a
NumPy twin otherwise.

`rotary(x, cos, sin, start=0, inverse=False, out=None)` → y: x (B, T, H, D), a strided view with
D contiguous, rotated pair by pair (i, i + D/2) by the angle of position start + t, whose cosine
and sine are row start + t of the tables `cos` and `sin` (positions, D/2) in the compute dtype
(float32; float64 for float64 x). `inverse=True` rotates back (the transpose: the backward).
`out` is where y goes: None for a new (B, T, H, D) array, or an array shaped like x (x itself
rotates in place). Computed in the compute dtype, rounded once to x's dtype.
"""
import numpy

from cupytp.backend import xp
from cupytp.launchers import ceil_div, compute_dtype, dtype_suffix, get_kernel, is_device_array

THREADS = 256
MAX_BLOCKS = 32768      # the kernel's grid-stride loop covers larger arrays
VECTOR_BYTES = 16


def rotary(x, cos, sin, start=0, inverse=False, out=None):
    out = _checked(x, cos, sin, start, out)
    if not is_device_array(x):
        out[...] = rotary_numpy(x, cos, sin, start, inverse)
        return out
    b, t, h, d = x.shape
    half = d // 2
    rows = b * t * h
    if not rows:
        return out
    vec = _vector(x, out, half)
    kernel = get_kernel("rotary.cu", f"rotary_{dtype_suffix(x.dtype)}_v{vec}")
    blocks = min(ceil_div(rows * (half // vec), THREADS), MAX_BLOCKS)
    compute = cos.dtype.type
    kernel((blocks,), (THREADS,), (x, out, cos, sin, numpy.int64(rows), numpy.int32(t),
                                   numpy.int32(h), numpy.int32(half), *_strides(x), *_strides(out),
                                   numpy.int64(start), compute(-1 if inverse else 1)))
    return out


def _checked(x, cos, sin, start, out):
    """`out` to write (a new array for None), after checking every argument."""
    if x.ndim != 4 or x.shape[-1] % 2 or (x.size and x.strides[-1] != x.itemsize):
        raise ValueError(f"rotary: x must be (B, T, H, D) with an even D and D contiguous, got "
                         f"shape {x.shape} strides {x.strides}")
    compute = compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if type(table) is not type(x) or table.dtype != compute or table.ndim != 2 or \
                table.shape[1] != half or not table.flags.c_contiguous:
            raise ValueError(f"rotary: {name} must be a contiguous {compute} table of "
                             f"(positions, {half}) of x's kind, got {type(table).__name__} "
                             f"{table.dtype} {table.shape}")
    if not 0 <= start or start + x.shape[1] > cos.shape[0] or sin.shape != cos.shape:
        raise ValueError(f"rotary: positions {start}..{start + x.shape[1] - 1} are outside the "
                         f"tables' {min(cos.shape[0], sin.shape[0])} rows: make the tables longer")
    if out is None:
        return xp.empty(x.shape, dtype=x.dtype) if is_device_array(x) else \
            numpy.empty(x.shape, dtype=x.dtype)
    if type(out) is not type(x) or out.shape != x.shape or out.dtype != x.dtype or \
            (out.size and out.strides[-1] != out.itemsize):
        raise ValueError(f"rotary: out must be shaped like x {x.shape} ({x.dtype}, D "
                         f"contiguous), got {out.dtype} {out.shape}")
    return out


def _vector(x, out, half):
    """Elements per vector: 16 bytes' worth where the pairs and every row start allow it."""
    vec = VECTOR_BYTES // x.itemsize
    if half % vec or (x.data.ptr | out.data.ptr) % VECTOR_BYTES:
        return 1
    for array in (x, out):
        if any(stride % (vec * array.itemsize) for stride in array.strides[:3]):
            return 1
    return vec


def _strides(a):
    """(batch, token, head) strides in elements."""
    return tuple(numpy.int64(stride // a.itemsize) for stride in a.strides[:3])


def rotary_numpy(x, cos, sin, start=0, inverse=False):
    """NumPy twin of `rotary` (the values; `rotary` writes them where asked)."""
    t, half = x.shape[1], x.shape[-1] // 2
    compute = cos.dtype
    c = cos[start:start + t][None, :, None, :]
    s = sin[start:start + t][None, :, None, :] * compute.type(-1 if inverse else 1)
    v = x.astype(compute)
    x1, x2 = v[..., :half], v[..., half:]
    return numpy.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
