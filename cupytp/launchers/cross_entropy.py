"""Cross-entropy over a (maybe vocabulary-sharded) last dimension: `cross_entropy.cu` for CuPy
arrays, a NumPy twin otherwise.

logits (..., cols) hold the global vocabulary columns [offset, offset + cols); columns at or past
`vocab_size` do not exist (padding: never read, zero gradient). Targets (...) are global indices.

`cross_entropy_forward(logits, targets, offset, vocab_size, ignore_index)` → (row_max, stats):
the max m of each row's existing columns and stats (..., 2) = (sum of exp(x - m), the target's
logit: 0 when another shard holds it, NaN for a target outside [0, vocab_size) that is not
ignore_index). `cross_entropy_backward(logits, row_max, row_sum, targets, grad, ...)` → dlogits
= (exp(x - M) / S - onehot(target)) · grad per row, zero in padding columns and ignored rows,
with the global M and S. Computed in float32 (float64 for float64); dlogits has the logits'
dtype, the per-row arrays the compute dtype.

`cross_entropy_forward_grad(logits, targets, offset, vocab_size, ignore_index, learned)` →
(row_max, stats, dlogits, expected), for logits holding every column, each row fitting a block's
shared memory (`forward_grad_fits`): the forward's statistics and, in the same pass (the row
read once, kept in shared memory), dlogits for the per-row gradient `learned` (1 element, the
compute dtype, kept by the caller across steps), which `expected` keeps for
`cross_entropy_backward(..., expected=, learned=, dx=)`: that writes into `dx` only the rows
whose gradient is not the expected one (bit for bit what it writes otherwise), and makes row 0's
gradient the one learned for the next forward. A training step whose loss gradient stays the
same (the mean's 1/count under a backward seeded with 1, times any fixed factor) so reads and
writes the logits once.

The kernels move 16-byte vectors where the columns are a multiple of the vector and the arrays
start on one (a logits view at another address takes the element-at-a-time form), and take exp
in float32 by the hardware's 2^x (about 1e-6 relative; `exp` itself in float64).
"""
import functools
import math

import numpy

from cupytp.backend import xp
from cupytp.launchers import BLOCK_THREADS, check_lists, compute_dtype, dtype_suffix, get_kernel
from cupytp.launchers import is_device_array, vector_width

NULL = numpy.uint64(0)

VECTOR_BYTES = 16       # the kernels' *_vV form moves V = 16 bytes / itemsize elements at once


def cross_entropy_forward(logits, targets, offset, vocab_size, ignore_index):
    """(row_max (...), stats (..., 2)) of this shard of the logits; see the module docstring."""
    if not is_device_array(logits):
        return cross_entropy_forward_numpy(logits, targets, offset, vocab_size, ignore_index)
    compute = _check(logits, targets)
    row_max = xp.empty(targets.shape, dtype=compute)
    stats = xp.empty(targets.shape + (2,), dtype=compute)
    _launch("cross_entropy_forward", logits, (logits, targets, row_max, stats), (logits,),
            offset, vocab_size, ignore_index)
    return row_max, stats


def cross_entropy_forward_grad(logits, targets, offset, vocab_size, ignore_index, learned):
    """(row_max, stats, dlogits for the per-row gradient learned[0], expected: that gradient)
    of logits holding every column; see the module docstring."""
    if not is_device_array(logits):
        return cross_entropy_forward_grad_numpy(logits, targets, offset, vocab_size,
                                                ignore_index, learned)
    compute = _check(logits, targets)
    _check_scalars(compute, learned=learned)
    if not forward_grad_fits(logits):
        raise ValueError(f"cross_entropy_forward_grad: a row of {logits.shape[-1]} "
                         f"{logits.dtype} is more than a block's shared memory "
                         f"({_shared_memory_limit()} bytes): use cross_entropy_forward")
    row_max = xp.empty(targets.shape, dtype=compute)
    stats = xp.empty(targets.shape + (2,), dtype=compute)
    dx, expected = xp.empty_like(logits), xp.empty(1, dtype=compute)
    _launch("cross_entropy_forward_grad", logits,
            (logits, targets, learned, expected, row_max, stats, dx), (logits, dx), offset,
            vocab_size, ignore_index, _row_bytes(logits))
    return row_max, stats, dx, expected


def forward_grad_fits(logits):
    """True when `cross_entropy_forward_grad` takes these logits: always for NumPy arrays; on
    the GPU where a row fits the dynamic shared memory of one block (50304 bf16 columns do,
    128256 do not)."""
    return not is_device_array(logits) or _row_bytes(logits) <= _shared_memory_limit()


def _row_bytes(logits):
    return -(-logits.shape[-1] * logits.itemsize // 16) * 16


@functools.cache
def _shared_memory_limit():
    """The most dynamic shared memory one block of this GPU may ask for."""
    return xp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]


def cross_entropy_backward(logits, row_max, row_sum, targets, grad, offset, vocab_size,
                           ignore_index, expected=None, learned=None, dx=None):
    """d loss / d logits of this shard, given the global per-row max and sum and d loss / d row;
    with `expected`, `learned` and `dx` (a forward_grad's), written into dx where the row's
    gradient is not the expected one."""
    if not is_device_array(logits):
        return cross_entropy_backward_numpy(logits, row_max, row_sum, targets, grad, offset,
                                            vocab_size, ignore_index, expected, learned, dx)
    compute = _check(logits, targets, row_max=row_max, row_sum=row_sum, grad=grad)
    if expected is None:
        dx, expected, learned = xp.empty_like(logits), NULL, NULL
    else:
        _check_scalars(compute, expected=expected, learned=learned)
        if dx.shape != logits.shape or dx.dtype != logits.dtype:
            raise ValueError(f"cross_entropy: dx must be {logits.dtype} {logits.shape}, got "
                             f"{dx.dtype} {dx.shape}")
    _launch("cross_entropy_backward", logits,
            (logits, row_max, row_sum, targets, grad, expected, learned, dx), (logits, dx),
            offset, vocab_size, ignore_index)
    return dx


def _check_scalars(compute, **scalars):
    for name, array in scalars.items():
        if array.dtype != compute or array.shape != (1,):
            raise ValueError(f"cross_entropy: {name} must be {compute} of shape (1,), got "
                             f"{array.dtype} {array.shape}")


def _check(logits, targets, **rows):
    """The compute dtype, after checking shapes, dtypes and contiguity."""
    dtype = check_lists(logits=[logits])["logits"]
    dtype_suffix(dtype)
    compute = compute_dtype(dtype)
    check_lists(targets=[targets])
    if targets.dtype != numpy.int64 or targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: targets must be int64 of shape {logits.shape[:-1]} "
                         f"(the logits' rows), got {targets.dtype} {targets.shape}")
    for name, array in rows.items():
        check_lists(**{name: [array]})
        if array.dtype != compute or array.shape != targets.shape:
            raise ValueError(f"cross_entropy: {name} must be {compute} of shape "
                             f"{targets.shape}, got {array.dtype} {array.shape}")
    return compute


def _launch(name, logits, arrays, rows_arrays, offset, vocab_size, ignore_index, shared=0):
    """One block of BLOCK_THREADS per row (a step's thousands of rows fill every multiprocessor
    many times over), with `shared` bytes of dynamic shared memory; the vector form where every
    array of `rows_arrays` (the logits' shape) allows it."""
    rows, cols = math.prod(logits.shape[:-1]), logits.shape[-1]
    if rows == 0:                        # launched even for 0 columns: the row stats exist
        return
    width = vector_width(VECTOR_BYTES // logits.itemsize, cols, rows_arrays)
    kernel = get_kernel("cross_entropy.cu", f"{name}_{dtype_suffix(logits.dtype)}_v{width}")
    if shared > kernel.raw.max_dynamic_shared_size_bytes:
        kernel.raw.max_dynamic_shared_size_bytes = shared
    kernel((rows,), (BLOCK_THREADS,), (*arrays, numpy.int32(cols), numpy.int64(offset),
                                       numpy.int64(vocab_size), numpy.int64(ignore_index)),
           shared_mem=shared)


def existing_columns(cols, offset, vocab_size):
    """How many of the columns [offset, offset + cols) lie below vocab_size."""
    return int(min(max(vocab_size - offset, 0), cols))


def cross_entropy_forward_numpy(logits, targets, offset, vocab_size, ignore_index):
    """NumPy twin of `cross_entropy_forward`."""
    compute = _check(logits, targets)
    existing = existing_columns(logits.shape[-1], offset, vocab_size)
    x = logits[..., :existing].astype(compute)
    m = x.max(axis=-1) if existing else numpy.full(targets.shape, -numpy.inf, compute)
    shift = numpy.where(numpy.isneginf(m), 0, m)[..., None]  # all -inf (or none): sum 0
    total = numpy.exp(x - shift).sum(axis=-1)
    local = targets - offset
    mine = (targets != ignore_index) & (local >= 0) & (local < existing)
    picked = numpy.zeros(targets.shape, compute)
    if existing:
        index = numpy.where(mine, local, 0)[..., None]
        picked = numpy.where(mine, numpy.take_along_axis(x, index, axis=-1)[..., 0], 0)
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    picked = numpy.where(bad, numpy.nan, picked)
    return m, numpy.stack([total, picked], axis=-1).astype(compute)


def cross_entropy_forward_grad_numpy(logits, targets, offset, vocab_size, ignore_index,
                                     learned):
    """NumPy twin of `cross_entropy_forward_grad`."""
    row_max, stats = cross_entropy_forward_numpy(logits, targets, offset, vocab_size,
                                                 ignore_index)
    _check_scalars(row_max.dtype, learned=learned)
    grad = numpy.full(targets.shape, learned[0], row_max.dtype)
    dx = cross_entropy_backward_numpy(logits, row_max, numpy.ascontiguousarray(stats[..., 0]),
                                      targets, grad, offset, vocab_size, ignore_index)
    return row_max, stats, dx, learned.copy()


def cross_entropy_backward_numpy(logits, row_max, row_sum, targets, grad, offset, vocab_size,
                                 ignore_index, expected=None, learned=None, dx=None):
    """NumPy twin of `cross_entropy_backward`."""
    compute = _check(logits, targets, row_max=row_max, row_sum=row_sum, grad=grad)
    existing = existing_columns(logits.shape[-1], offset, vocab_size)
    x = logits[..., :existing].astype(row_max.dtype)
    onehot = numpy.arange(offset, offset + existing) == targets[..., None]
    d = numpy.exp(x - row_max[..., None]) * (grad / row_sum)[..., None] \
        - numpy.where(onehot, grad[..., None], 0)
    written = numpy.zeros(logits.shape, logits.dtype)
    written[..., :existing] = numpy.where((targets != ignore_index)[..., None], d, 0)
    if expected is None:
        return written
    _check_scalars(compute, expected=expected, learned=learned)
    other = grad != expected[0]
    dx[other] = written[other]
    first = grad.reshape(-1)[:1]
    if first.size and first[0] != expected[0] and numpy.isfinite(first[0]) and first[0] != 0:
        learned[0] = first[0]
    return dx
