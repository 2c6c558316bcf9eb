"""Multi-tensor apply: one kernel launch over a whole list of arrays, and two ops built on it.

A `TensorTable` is the device-side description of parallel lists of arrays (params, grads, ...):
a row of data pointers per list, and per block the (tensor, start, end) of the chunk it works on.
Rows are kept by their pointers and chunk lists by the sizes, so a training loop copies only the
row of a list whose arrays are new (its gradients, when they move) from pinned host memory, with
no host synchronization. A row first needed while a CUDA graph is being captured is copied by the
graph itself, from pinned host memory, at the start of every replay.

`sum_of_squares` (for gradient norms), `scale_` (for clipping), `unscale_check_` (for dynamic
loss scaling) and `cast_` (autocast's casts of the parameters, refreshed in one launch) run
`multi_tensor.cu` on CuPy arrays and NumPy twins otherwise; the optimizers (`adamw.py`,
`sgd.py`) use the tables too.
"""
import collections
import dataclasses

import numpy

from cupytp import graph
from cupytp.backend import bfloat16, xp
from cupytp.launchers import BLOCK_THREADS, ceil_div, check_lists, compute_dtype, dtype_suffix
from cupytp.launchers import get_kernel, is_device_array

CHUNK = 65536  # elements per block
THREADS = 512  # multi-tensor apply; the reductions run with BLOCK_THREADS
MAX_TABLES = 64        # pointer rows, and chunk lists, kept (least recently used dropped)
_ROWS = collections.OrderedDict()      # data pointers of one list -> int64 device row
_CHUNKS = collections.OrderedDict()    # sizes -> int64 device (num_blocks, 3)
_UPLOADS = collections.deque()         # (event, pinned host buffer) of copies in flight


@dataclasses.dataclass(frozen=True)
class TensorTable:
    """Device table for one multi-tensor launch over parallel lists of arrays.

    rows[k]: int64 (num_tensors,), the data pointers of list k; blocks: int64 (num_blocks, 3),
    the (tensor, start, end) chunk of each block, at most CHUNK elements.
    """

    rows: tuple
    blocks: object
    num_blocks: int


def tensor_table(lists):
    """The TensorTable of parallel lists of CuPy arrays (None in a list after the first: a null
    pointer, a tensor that list leaves out). Each list's row of pointers and the
    chunks of the sizes are kept apart, so a list of arrays new every step (gradients) costs one
    small asynchronous copy and the others none. Inside a capture a new row is the graph's own
    (see the module docstring)."""
    sizes = tuple(array.size for array in lists[0])
    rows = tuple(_kept(_ROWS, tuple(0 if array is None else array.data.ptr for array in arrays))
                 for arrays in lists)
    blocks = _kept(_CHUNKS, sizes)
    return TensorTable(rows, blocks, len(blocks))


def _kept(cache, key):
    """The device array of `key` (pointers, or sizes to chunk) from `cache`, uploaded the first
    time; one that a capture reads stays alive as long as its graph."""
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
        graph.keep_alive(value)
        return value
    host = numpy.array(key, dtype=numpy.int64) if cache is _ROWS else chunk_blocks(key)
    memo = graph.capture_memo()
    if memo is None:
        value = cache[key] = _upload(host)
        if len(cache) > MAX_TABLES:
            cache.popitem(last=False)
        return value
    value = memo.get((id(cache), key))
    if value is None:               # its values reach the device only when the graph runs
        value = memo[(id(cache), key)] = _upload(host, in_capture=True)
    return value


def chunk_blocks(sizes, chunk=CHUNK):
    """int64 (num_blocks, 3): the (tensor, start, end) of each block, chunks of at most `chunk`
    elements covering the tensors in order (none for an empty tensor)."""
    sizes = numpy.asarray(sizes, dtype=numpy.int64)
    chunks = ceil_div(sizes, chunk)  # (num_tensors,)
    tensor = numpy.repeat(numpy.arange(len(sizes), dtype=numpy.int64), chunks)  # (num_blocks,)
    first_block = numpy.cumsum(chunks) - chunks  # (num_tensors,)
    start = (numpy.arange(len(tensor)) - first_block[tensor]) * chunk
    end = numpy.minimum(start + chunk, sizes[tensor])
    return numpy.stack([tensor, start, end], axis=1)


def _upload(host, in_capture=False):
    """A device copy of `host`, made on the current stream from pinned memory: no host
    synchronization, and legal while capturing (then the graph copies it at every replay, and
    keeps the pinned buffer). Outside a capture the buffer is kept until its copy is done."""
    import cupyx
    pinned = cupyx.empty_pinned(host.shape, host.dtype)
    pinned[...] = host
    device = xp.empty(host.shape, host.dtype)
    runtime = xp.cuda.runtime       # CuPy's own copies refuse to run while capturing
    stream = xp.cuda.get_current_stream()
    runtime.memcpyAsync(device.data.ptr, pinned.ctypes.data, host.nbytes,
                        runtime.memcpyHostToDevice, stream.ptr)
    if in_capture:
        graph.keep_alive((pinned, device))
    else:
        while _UPLOADS and _UPLOADS[0][0].done:
            _UPLOADS.popleft()
        _UPLOADS.append((stream.record(), pinned))
    return device


def check_optimizer_lists(params, grads, *, checked=False, **states):
    """Validate an optimizer's lists (see check_lists); return (param dtype, grad dtype), or None.

    params and the state lists (moments, momentum buffers) share one dtype, float32 or float64;
    grads have the params' dtype or are bfloat16/float16 (widened on load). None for empty lists.
    `checked`: the lists hold check_lists's invariants by construction (an Optimizer's buckets:
    one dtype per list, states made like their parameters, gradients laid out like them and
    C-contiguous), so only the dtypes of their first arrays are checked.
    """
    if checked:
        if not params:
            return None
        dtypes = {"params": params[0].dtype, "grads": grads[0].dtype,
                  **{name: arrays[0].dtype for name, arrays in states.items()}}
    else:
        dtypes = check_lists(params=params, grads=grads, **states)
        if not dtypes:
            return None
    param_dtype = dtypes.pop("params")
    grad_dtype = dtypes.pop("grads")
    if param_dtype not in (numpy.float32, numpy.float64):
        raise ValueError(f"params must be float32 or float64, got {param_dtype}")
    for name, dtype in dtypes.items():
        if dtype != param_dtype:
            raise ValueError(f"{name} must have the params' dtype {param_dtype}, got {dtype}")
    if grad_dtype not in (param_dtype, bfloat16, numpy.float16):
        raise ValueError(f"grads must be {param_dtype}, bfloat16 or float16 (params are "
                         f"{param_dtype}), got {grad_dtype}")
    return param_dtype, grad_dtype


def _check_arrays(arrays):
    """The one dtype of a non-empty list of arrays with kernels."""
    dtypes = check_lists(arrays=arrays)
    if not dtypes:
        raise ValueError("needs at least one array")
    dtype_suffix(dtypes["arrays"])
    return dtypes["arrays"]


def sum_of_squares(arrays):
    """Sum of x^2 over all elements of all arrays (one dtype): a 0-d array, accumulated in
    float64 for float64 and in float32 for float32/bfloat16/float16.

    On the GPU: one launch writes a partial sum per block, a second one-block launch adds the
    partials in a fixed order (deterministic). No host synchronisation.
    """
    if not (arrays and is_device_array(arrays[0])):
        return sum_of_squares_numpy(arrays)
    dtype = _check_arrays(arrays)
    compute = compute_dtype(dtype)
    table = tensor_table([arrays])
    if table.num_blocks == 0:
        return xp.zeros((), compute)
    partials = xp.empty(table.num_blocks, compute)
    out = xp.empty((), compute)
    get_kernel("multi_tensor.cu", f"sum_of_squares_partials_{dtype_suffix(dtype)}")(
        (table.num_blocks,), (BLOCK_THREADS,), (table.rows[0], table.blocks, partials))
    get_kernel("multi_tensor.cu", f"sum_partials_{dtype_suffix(compute)}")(
        (1,), (BLOCK_THREADS,), (partials, numpy.int64(table.num_blocks), out))
    return out


def scale_(arrays, factor):
    """Multiply every array (one dtype) in place by factor, a 0-d array (or a number).

    The product is computed in the compute dtype (see sum_of_squares) and rounded back. For CuPy
    arrays, a 0-d CuPy factor is read on the device, so clipping by a computed norm needs no host
    synchronisation.
    """
    if not (arrays and is_device_array(arrays[0])):
        scale_numpy(arrays, factor)
        return
    dtype = _check_arrays(arrays)
    factor = xp.asarray(factor, dtype=compute_dtype(dtype))
    if factor.ndim != 0:
        raise ValueError(f"factor must be 0-d, got shape {factor.shape}")
    table = tensor_table([arrays])
    if table.num_blocks == 0:
        return
    get_kernel("multi_tensor.cu", f"scale_{dtype_suffix(dtype)}")(
        (table.num_blocks,), (THREADS,), (table.rows[0], table.blocks, factor))


def unscale_check_(arrays, inv_scale, found_inf):
    """Multiply every array (one dtype) in place by `inv_scale` (a float32 array of one element,
    read on the device) and set `found_inf` (float32, one element) to 1 if any product is not
    finite; found_inf is never cleared here. The product is taken in the compute dtype."""
    if not (arrays and is_device_array(arrays[0])):
        unscale_check_numpy(arrays, inv_scale, found_inf)
        return
    dtype = _check_arrays(arrays)
    _check_flag("inv_scale", inv_scale)
    _check_flag("found_inf", found_inf)
    table = tensor_table([arrays])
    if table.num_blocks:
        get_kernel("multi_tensor.cu", f"unscale_check_{dtype_suffix(dtype)}")(
            (table.num_blocks,), (THREADS,), (table.rows[0], table.blocks, inv_scale, found_inf))


CAST_PAIRS = {("f32", "bf16"), ("f32", "f16")}


def cast_(sources, targets):
    """targets[i][...] = sources[i] converted to the targets' dtype (float32 sources, bfloat16
    or float16 targets of the same shapes), one launch for the lists; the rounding of
    `cast.converted`."""
    if not (sources and is_device_array(sources[0])):
        cast_numpy(sources, targets)
        return
    pair = _cast_pair(sources, targets)
    table = tensor_table([sources, targets])
    if table.num_blocks:
        get_kernel("multi_tensor.cu", f"cast_{pair}")(
            (table.num_blocks,), (THREADS,), (table.rows[0], table.rows[1], table.blocks))


def _cast_pair(sources, targets):
    """The kernel suffix of a cast between two lists, after checking them."""
    dtypes = check_lists(sources=sources, targets=targets)
    pair = (dtype_suffix(dtypes["sources"]), dtype_suffix(dtypes["targets"]))
    if pair not in CAST_PAIRS:
        raise ValueError(f"cast_ takes float32 sources and bfloat16 or float16 targets, got "
                         f"{dtypes['sources']} and {dtypes['targets']}")
    return "_".join(pair)


def cast_numpy(sources, targets):
    """NumPy twin of `cast_`."""
    if not sources:
        return
    _cast_pair(sources, targets)
    for source, target in zip(sources, targets):
        target[...] = source.astype(target.dtype)


def _check_flag(name, array):
    if array.dtype != numpy.float32 or array.size != 1:
        raise ValueError(f"{name} must be a float32 array of one element, got {array.dtype} "
                         f"{array.shape}")


def unscale_check_numpy(arrays, inv_scale, found_inf):
    """NumPy twin of `unscale_check_`."""
    if not arrays:
        return
    dtype = _check_arrays(arrays)
    _check_flag("inv_scale", inv_scale)
    _check_flag("found_inf", found_inf)
    compute = compute_dtype(dtype)
    factor = numpy.asarray(inv_scale, dtype=numpy.float32).reshape(()).astype(compute)
    for array in arrays:
        with numpy.errstate(over="ignore", invalid="ignore"):
            product = array.astype(compute) * factor
        if not numpy.isfinite(product).all():
            found_inf[...] = 1
        array[...] = product.astype(dtype)


def sum_of_squares_numpy(arrays):
    """NumPy twin of `sum_of_squares`."""
    compute = compute_dtype(_check_arrays(arrays))
    total = compute.type(0)
    for array in arrays:
        wide = array.astype(compute)
        total += numpy.sum(wide * wide, dtype=compute)
    return numpy.asarray(total, dtype=compute)


def scale_numpy(arrays, factor):
    """NumPy twin of `scale_`."""
    if not arrays:
        return
    dtype = _check_arrays(arrays)
    factor = numpy.asarray(factor, dtype=compute_dtype(dtype))
    if factor.ndim != 0:
        raise ValueError(f"factor must be 0-d, got shape {factor.shape}")
    for array in arrays:
        array[...] = (array.astype(factor.dtype) * factor).astype(dtype)
