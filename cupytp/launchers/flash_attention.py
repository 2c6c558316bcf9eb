"""Flash attention over (B, H, T, D) queries and (B, Hk, S, D) keys and values:
`flash_attention.cu` for CuPy arrays, a NumPy twin of the same math otherwise (the twin stores the
scores; the kernel never does).

`attention_forward(q, k, v, causal, scale, dropout, groups=None)` → (o, lse): o = softmax(scale q
kᵀ) v in q's dtype, returned as a (B, H, T, D) view of (B, T, H, D) memory (so o.transpose(1, 2)
is contiguous); lse (B, H, T) float32, the log-sum-exp of each row of scaled scores (-inf for a
query that sees no key). `attention_backward(q, k, v, o, lse, do, causal, scale, dropout,
grads=None, groups=None)` → (dq, dk, dv), laid out like o, or written into `grads` (three arrays
shaped like q, k and v with contiguous rows: views into one packed gradient, say). Causal: query t
sees keys s <= t + S - T. Inputs may be strided views; bf16 or fp16, head dim 64 or 128
(`supported`); fp32 accumulation.

On a compute capability 9.0 GPU (Hopper) the kernels are built for sm_90a and multiply with
warpgroup products (wgmma) from swizzled shared tiles, the rest of their math unchanged;
`CUPYTP_FLASH_WGMMA=0` keeps mma.sync there too.

Grouped-query attention: k and v may have fewer heads than q. Query head h reads key/value head
(h + groups.offset) // groups.group (a `HeadGroups`; by default group = H / Hk and offset 0),
without copying k or v; dk and dv sum over the query heads that read each key/value head (zero for
one that none reads).

Dropout (an `AttentionDropout`, or None) zeroes the probability (b, h, t, s) unless philox.py's
dropout rule keeps counter base + add + row-major index of (b + batch_offset, h + head_offset, t,
s) in (B, heads, T, S), and scales the kept ones by 1/(1-p): the draw of `cupytp.tensor.random`,
so the mask equals `ops.dropout`'s on the (B, H, T, S) probabilities. The kernels draw one Philox
call per eight keys and share its bits across the lanes that hold them where S and base + add
are multiples of 8 (always, but for S) and a block's key positions run in eights, else a call
per probability. Plain dropout (no position maps) may keep those bits for the backward: a
`kept_bits(q, k)` store given as the dropout's `mask` is written by the forward (one bit a
visible score: 1/16 of the bf16 scores) and read by the backward instead of drawing again.
"""
import functools
from typing import NamedTuple

import numpy

from cupytp import backend, env
from cupytp.backend import bfloat16, c_contiguous, xp
from cupytp.launchers import ceil_div, dtype_suffix, get_kernel, is_device_array
from cupytp.launchers.philox import dropout_keeps, keep_threshold

HEAD_DIMS = (64, 128)
DTYPES = (bfloat16, numpy.dtype(numpy.float16))
BLOCK_M = BLOCK_N = 64   # queries and keys per tile, as in flash_attention.cu
PAD = 8                  # elements after each shared-memory row, as in flash_attention.cu
THREADS = 128
BACKWARD_BLOCK_N = 128   # keys per block of the backward, as in flash_attention.cu
BACKWARD_THREADS = 256
DQ_THREADS = 256                 # flash_backward_dq: eight elements a thread
NULL = numpy.uint64(0)
MAX_PLANS = 256                  # planned shapes kept (all dropped when full)


class HeadGroups(NamedTuple):
    """Which key/value head each query head reads: query head h (local index) reads key/value
    head (h + offset) // group, `group` query heads per key/value head. offset > 0 where a rank
    holds every key/value head but only some of the query heads (offset: the global index of
    its first query head)."""
    group: int
    offset: int = 0


def head_groups(q, k, groups=None):
    """`groups`, or the plain grouping of q's heads over k's (H / Hk query heads each)."""
    if groups is not None:
        return HeadGroups(int(groups.group), int(groups.offset))
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk:
        raise ValueError(f"attention: {hq} query heads do not group evenly over {hk} key/value "
                         "heads: give the head groups")
    return HeadGroups(hq // hk)


class AttentionDropout(NamedTuple):
    """Dropout of the attention probabilities: p, the generator's (seed, base, add) for
    B·heads·T·S counters, the global head count and this tensor's batch and head offsets. A block
    of a longer sequence (context parallelism's) gives the global position of each of its
    queries and keys (`rows`, `cols`: int64 arrays of the inputs' module; None: the index itself)
    and the global query and key counts (`t_global`, `s_global`; 0: the block's own). Plain
    dropout may give a `kept_bits` store as `mask`: the forward writes the bits the backward
    then reads (None: the backward draws them again)."""
    p: float
    seed: int
    base: object
    add: int
    heads: int
    batch_offset: int = 0
    head_offset: int = 0
    rows: object = None
    cols: object = None
    t_global: int = 0
    s_global: int = 0
    mask: object = None


def kept_bits(q, k):
    """The store of a plain dropout's kept bits for attention over device arrays q (B, H, T, D)
    and k (B, Hk, S, D), uint8 (B·H, T, S rounded up to 128 keys / 8): byte o of a row holds keys
    8 o .. 8 o + 7. None for NumPy arrays, and where it would take more than twice the bytes of
    the output (S > 32 D): long sequences draw their bits again in the backward."""
    b, h, t, d = q.shape
    s = k.shape[2]
    if not is_device_array(q) or s > 32 * d:
        return None
    return xp.empty((b * h, t, _mask_pitch(s)), dtype=numpy.uint8)


def _mask_pitch(s):
    """Bytes per query row of the kept bits: S rounded up to the backward's 128-key blocks."""
    return ceil_div(s, BACKWARD_BLOCK_N) * BACKWARD_BLOCK_N // 8


def supported(q, k, v):
    """True when the kernel takes these arrays: one dtype, bf16 or fp16, head dim 64 or 128."""
    return (q.dtype in DTYPES and q.dtype == k.dtype == v.dtype and q.ndim == 4
            and q.shape[-1] in HEAD_DIMS)


def attention_forward(q, k, v, causal, scale, dropout=None, groups=None):
    if not is_device_array(q):
        groups = _check(groups, q=q, k=k, v=v)
        return attention_forward_numpy(q, k, v, causal, scale, dropout, groups)
    if type(k) is not type(q) or type(v) is not type(q):
        _check(groups, q=q, k=k, v=v)           # the error naming the mix of kinds
    arrays = _read_in_place((q, k, v))
    o, lse = _outputs(q)
    _planned(_ForwardPlan, arrays, causal, scale, dropout, groups)(
        *arrays, o, lse, *_dropout_values(dropout, q, k.shape[2]))
    return o, lse


def attention_backward(q, k, v, o, lse, do, causal, scale, dropout=None, grads=None,
                       groups=None):
    if not is_device_array(q):
        groups = _check(groups, q=q, k=k, v=v, o=o, do=do)
        check_lse(lse, q)
        grads = check_grads(grads, q, k, v)
        return fill(grads, attention_backward_numpy(q, k, v, o, lse, do, causal, scale, dropout,
                                                    groups))
    if any(type(a) is not type(q) for a in (k, v, o, do)):
        _check(groups, q=q, k=k, v=v, o=o, do=do)      # the error naming the mix of kinds
    grads = check_grads(grads, q, k, v)
    arrays = _read_in_place((q, k, v, o, do))
    check_lse(lse, q)
    lse = lse if c_contiguous(lse) else xp.ascontiguousarray(lse)   # read as (B, H, T) rows
    _planned(_BackwardPlan, arrays + grads, causal, scale, dropout, groups)(
        *arrays, lse, *grads, *_dropout_values(dropout, q, k.shape[2]))
    return grads


_plans = {}     # (plan class, dtype, causal, scale, dropout's fixed part, head groups, the
                # arrays' types, shapes and strides) -> plan


def _planned(kind, arrays, causal, scale, dropout, groups):
    """The plan of `kind` for arrays of these types, shapes, strides and dtype, made (and the
    arrays checked) on first use."""
    fixed = None if dropout is None else (dropout.p, dropout.heads, dropout.batch_offset,
                                          dropout.head_offset, dropout.rows is None,
                                          dropout.cols is None, dropout.t_global,
                                          dropout.s_global, dropout.mask is None)
    key = (kind, arrays[0].dtype, causal, scale, fixed, groups,
           *[(type(a), a.shape, a.strides) for a in arrays])
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = kind(arrays, causal, float(scale), dropout, groups)
    return plan


def _read_in_place(arrays):
    """The arrays, each itself where the kernels read it in place (D contiguous, 16-byte aligned
    rows and start), else a contiguous copy."""
    pointers = 0
    for a in arrays:
        pointers |= a.data.ptr
    if pointers % 16 or not all(_rows_aligned(a) for a in arrays):
        return tuple(xp.ascontiguousarray(a) if a.data.ptr % 16 or not _rows_aligned(a) else a
                     for a in arrays)
    return arrays


def _rows_aligned(a):
    """True when `a`'s strides let the kernels read it in place (see `_read_in_place`)."""
    return a.ndim == 4 and a.strides[3] == a.itemsize and all(
        stride % 16 == 0 for stride, n in zip(a.strides[:3], a.shape[:3]) if n > 1)


def _outputs(q):
    """(o, lse) of a forward over q: like_output(q) and float32 (B, H, T), one allocation."""
    b, h, t, d = q.shape
    o_bytes = -(-b * t * h * d * q.itemsize // 256) * 256
    block = xp.empty(o_bytes + 4 * b * h * t, dtype=numpy.uint8)
    o = xp.ndarray((b, t, h, d), q.dtype, block.data).transpose(0, 2, 1, 3)
    return o, xp.ndarray((b, h, t), numpy.float32, block.data + o_bytes)


class _ForwardPlan:
    """The forward's launch for arrays like (q, k, v): called with (q, k, v, o, lse, then the
    dropout's seed, base and counter offset when it has one)."""

    def __init__(self, arrays, causal, scale, dropout, groups):
        q, k, v = arrays
        group, offset = _check(groups, q=q, k=k, v=v)
        b, h, t, d = q.shape
        self.launch = None if not q.size else _kernel("forward", d, q.dtype, _variant(dropout))\
            .planned((b * h, ceil_div(t, BLOCK_M)), (THREADS,),
                     (None,) * 5 + (numpy.int32(h), numpy.int32(group), numpy.int32(offset),
                                    numpy.int32(t), numpy.int32(k.shape[2]),
                                    *_strides(q), *_strides(k), *_strides(v),
                                    *[numpy.int64(x // q.itemsize)
                                      for x in output_strides(q)[:3]],
                                    numpy.float32(scale), numpy.int32(causal),
                                    *_dropout_template(dropout, t, k.shape[2])),
                     shared_mem=_shared_bytes("forward", d))

    def __call__(self, *args):
        if self.launch is not None:
            self.launch(*args)


class _BackwardPlan:
    """The backward's launches for arrays like (q, k, v, o, do, dq, dk, dv): delta (which also
    zeroes dq's float32 sums), the key blocks (dq added into those sums), dq. Called with (q, k,
    v, o, do, lse, dq, dk, dv, the dropout's open values)."""

    def __init__(self, arrays, causal, scale, dropout, groups):
        q, k, v, o, do, dq, dk, dv = arrays
        group, offset = _check(groups, q=q, k=k, v=v, o=o, do=do)
        b, h, t, d = q.shape
        hk, s = k.shape[1], k.shape[2]
        self.empty = not (q.size and k.size)       # no query or no key: nothing flows back
        self.delta_bytes = -(-b * h * t * 4 // 256) * 256      # delta (B, H, T) float32, then
        self.accum_bytes = b * h * t * d * 4                  # dq's float32 (B, H, T, D) sums
        self.launches = None if self.empty else (
            _kernel("backward_delta", d, q.dtype).planned(
                (ceil_div(t * d, THREADS * 8), b * h), (THREADS,),
                (None, None, None, None, numpy.int32(h), numpy.int32(t), *_strides(o),
                 *_strides(do))),
            _kernel("backward", d, q.dtype, _variant(dropout)).planned(
                (b * hk, ceil_div(s, BACKWARD_BLOCK_N)), (BACKWARD_THREADS,),
                (None,) * 9 + (numpy.int32(h), numpy.int32(hk), numpy.int32(group),
                               numpy.int32(offset), numpy.int32(t), numpy.int32(s), *_strides(q),
                               *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
                               *_strides(dv), numpy.float32(scale), numpy.int32(causal),
                               *_dropout_template(dropout, t, s)),
                shared_mem=_shared_bytes("backward", d)),
            _kernel("backward_dq", d, q.dtype).planned(
                (ceil_div(t * d, DQ_THREADS * 8), b * h), (DQ_THREADS,),
                (None, None, numpy.int32(h), numpy.int32(t), *_strides(dq),
                 numpy.float32(scale))))

    def __call__(self, q, k, v, o, do, lse, dq, dk, dv, *dropout_values):
        if self.empty:
            for grad in (dq, dk, dv):
                grad.fill(0)
            return
        delta_launch, backward_launch, dq_launch = self.launches
        work = xp.empty(self.delta_bytes + self.accum_bytes, dtype=numpy.uint8)
        delta = work.data.ptr
        accum = delta + self.delta_bytes
        delta_launch(o, do, delta, accum)
        backward_launch(q, k, v, do, lse, delta, accum, dk, dv, *dropout_values)
        dq_launch(accum, dq)


def _check(groups, **arrays):
    """The head groups (checked, or the plain grouping), after checking the arrays."""
    q = arrays["q"]
    kinds = {type(a) for a in arrays.values()}
    if len(kinds) != 1:     # both kinds are named ndarray: name their modules too
        names = sorted(f"{kind.__module__.split('.')[0]}.{kind.__name__}" for kind in kinds)
        raise ValueError(f"flash attention: arrays of one kind needed, got {names}: NumPy and "
                         "CuPy arrays cannot be mixed")
    if not supported(q, arrays["k"], arrays["v"]):
        raise ValueError(f"flash attention takes (B, H, T, D) bf16 or fp16 arrays of one dtype "
                         f"with D in {HEAD_DIMS}; got q {q.dtype} {q.shape}, k "
                         f"{arrays['k'].dtype} {arrays['k'].shape}, v {arrays['v'].dtype} "
                         f"{arrays['v'].shape}: use the matmul path for these")
    b, h, t, d = q.shape
    hk, s = arrays["k"].shape[1:3]
    expected = {"q": (b, h, t, d), "k": (b, hk, s, d), "v": (b, hk, s, d), "o": (b, h, t, d),
                "do": (b, h, t, d)}
    for name, array in arrays.items():
        if array.shape != expected[name] or array.dtype != q.dtype:
            raise ValueError(f"flash attention: {name} must be {q.dtype} {expected[name]} to go "
                             f"with q {q.shape}, got {array.dtype} {array.shape}")
    if b * h > 65535:
        raise ValueError(f"flash attention: batch x heads = {b * h} exceeds the grid's 65535: "
                         "split the batch")
    if max(t, s) > 65535 * BLOCK_M:
        raise ValueError(f"flash attention: {max(t, s)} queries or keys exceed the grid's "
                         f"{65535 * BLOCK_M}: split the sequence (context parallelism)")
    groups = head_groups(q, arrays["k"], groups)
    if groups.group < 1 or groups.offset < 0 or (h and (h - 1 + groups.offset) // groups.group
                                                   >= hk):
        raise ValueError(f"flash attention: query heads 0..{h - 1} read key/value heads "
                         f"(h + {groups.offset}) // {groups.group}, outside k's {hk} heads")
    return groups


def check_grads(grads, q, k, v):
    """(dq, dk, dv) to write: `grads` when given (arrays shaped like q, k, v with contiguous rows
    of D, e.g. views into one packed q|k|v gradient), else new arrays (like_output)."""
    if grads is None:
        return like_output(q), like_output(k), like_output(v)
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if type(grad) is not type(like) or grad.shape != like.shape or grad.dtype != like.dtype \
                or (grad.size and grad.strides[3] != grad.itemsize):
            raise ValueError(f"attention backward: {name} must be a {like.dtype} "
                             f"{type(like).__name__} of shape {like.shape} with contiguous "
                             f"rows, got {type(grad).__name__} {grad.dtype} {grad.shape}")
    return tuple(grads)


def fill(grads, values):
    """`values` copied into `grads` (the NumPy twin's results into the asked-for arrays)."""
    for grad, value in zip(grads, values):
        grad[...] = value
    return grads


def check_lse(lse, q):
    """lse must be float32 (B, H, T) of q's kind (any strides)."""
    if type(lse) is not type(q) or lse.dtype != numpy.float32 or lse.shape != q.shape[:3]:
        raise ValueError(f"flash attention: lse must be a float32 {type(q).__name__} of shape "
                         f"{q.shape[:3]} (the forward's), got {type(lse).__name__} {lse.dtype} "
                         f"{lse.shape}")


def like_output(a):
    """An uninitialized (B, H, T, D) view of (B, T, H, D) memory, a's dtype."""
    b, h, t, d = a.shape
    return xp.empty((b, t, h, d), dtype=a.dtype).transpose(0, 2, 1, 3)


def output_strides(a):
    """The byte strides `like_output(a)` has."""
    b, h, t, d = a.shape
    size = a.itemsize
    return (t * h * d * size, d * size, h * d * size, size)


def _strides(a):
    """(batch, head, row) strides in elements."""
    return tuple(numpy.int64(stride // a.itemsize) for stride in a.strides[:3])


def _shared_bytes(kind, d):
    pad, align = (0, 1024) if _wgmma() else (PAD, 0)   # swizzled tiles, 1024-byte aligned
    row = (d + pad) * 2
    if kind == "forward":
        return (BLOCK_M + 2 * BLOCK_N) * row + align
    # k, v; q, do in two buffers; dsᵀ; lse and delta
    return (2 * BACKWARD_BLOCK_N + 4 * BLOCK_M) * row + BACKWARD_BLOCK_N * (BLOCK_M + pad) * 2 + \
        2 * BLOCK_M * 4 + align


def _variant(dropout):
    """The kernels' name tag for a dropout: none, plain, or at given positions."""
    if dropout is None:
        return ""
    return "_dropout" if dropout.rows is None and dropout.cols is None else "_dropout_at"


@functools.cache
def _wgmma():
    """Whether the kernels run on Hopper's warpgroup products: a compute capability 9.0 device
    (sm_90a code) and CUPYTP_FLASH_WGMMA=1."""
    return env.get("CUPYTP_FLASH_WGMMA") and xp.cuda.Device().compute_capability == "90"


@functools.cache
def _kernel(kind, d, dtype, variant=""):
    name = f"flash_{kind}_d{d}{variant}_{dtype_suffix(dtype)}"
    hopper = ("-DFLASH_HOPPER=1", "-arch=sm_90a") if _wgmma() else ()
    kernel = get_kernel("flash_attention.cu", name, (f"-DFLASH_HEAD_DIM={d}",) + hopper)
    if kind in ("forward", "backward"):
        kernel.raw.max_dynamic_shared_size_bytes = _shared_bytes(kind, d)
    return kernel


def _dropout_template(dropout, t, s):
    """The kernels' dropout arguments in a planned launch's template for t queries and s keys:
    threshold, scale, then the seed, base and counter offset left open (`_dropout_values`),
    heads and offsets, the position maps left open, the global counts, the kept bits' store
    left open and its row pitch."""
    if dropout is None:
        return (NULL, numpy.float32(1), NULL, NULL, NULL, numpy.int32(0), numpy.int32(0),
                numpy.int32(0), NULL, NULL, numpy.int64(0), numpy.int64(0), NULL, numpy.int64(0))
    return (numpy.uint64(keep_threshold(dropout.p)), numpy.float32(1 / (1 - dropout.p)),
            numpy.uint64, None, numpy.uint64, numpy.int32(dropout.heads),
            numpy.int32(dropout.head_offset), numpy.int32(dropout.batch_offset), None, None,
            numpy.int64(dropout.t_global or t), numpy.int64(dropout.s_global or s), None,
            numpy.int64(_mask_pitch(s)))


def _dropout_values(dropout, q, s):
    """The open dropout arguments of one call over queries q and s keys: (seed, base, counter
    offset, the query and key position maps, the kept bits' store), or ()."""
    if dropout is None:
        return ()
    maps = [0 if m is None else _positions(m) for m in (dropout.rows, dropout.cols)]  # 0: null
    return (numpy.uint64(dropout.seed), dropout.base, numpy.uint64(dropout.add), *maps,
            0 if dropout.mask is None else _store(dropout, q, s))


def _store(dropout, q, s):
    b, h, t, _ = q.shape
    shape = (b * h, t, _mask_pitch(s))
    mask = dropout.mask
    if dropout.rows is not None or dropout.cols is not None:
        raise ValueError("flash attention: kept dropout bits are for plain dropout; a block "
                         "with position maps draws its bits again (give mask=None)")
    if type(mask) is not type(q) or mask.dtype != numpy.uint8 or mask.shape != shape \
            or not c_contiguous(mask):
        raise ValueError(f"flash attention: the dropout's kept bits must be a contiguous uint8 "
                         f"{type(q).__name__} of shape {shape} (kept_bits(q, k)), got "
                         f"{type(mask).__name__} {getattr(mask, 'dtype', None)} "
                         f"{getattr(mask, 'shape', None)}")
    return mask


def _positions(array):
    if array.dtype != numpy.int64 or not c_contiguous(array):
        raise ValueError(f"flash attention: a dropout position map must be a contiguous int64 "
                         f"array, got {array.dtype}")
    return array


# ---- NumPy twin ---------------------------------------------------------------------------------
def dropout_keep(dropout, shape):
    """Boolean NumPy mask of the kept probabilities of a (B, H, T, S) block."""
    return backend.asnumpy(dropout_mask(dropout, shape))


def dropout_mask(dropout, shape):
    """Boolean mask of the kept probabilities of a (B, H, T, S) block, in the module of the
    dropout's base: element (b, h, t, s) draws counter base + add + ((b + batch_offset)·heads +
    h + head_offset)·T·S + rows[t]·S + cols[s] (T, S the global counts)."""
    b, h, t, s = shape
    xp = backend.array_module(dropout.base)
    u64 = xp.uint64
    t_global, s_global = dropout.t_global or t, dropout.s_global or s
    rows, cols = (xp.arange(n, dtype=u64) if m is None else xp.asarray(m).astype(u64)
                  for m, n in ((dropout.rows, t), (dropout.cols, s)))
    bh = (xp.arange(b, dtype=u64)[:, None] + u64(dropout.batch_offset)) * u64(dropout.heads) \
        + xp.arange(h, dtype=u64)[None, :] + u64(dropout.head_offset)
    counter = ((bh * u64(t_global * s_global))[:, :, None, None]
               + (rows * u64(s_global))[:, None] + cols[None, :]) \
        + (dropout.base + u64(dropout.add))
    return dropout_keeps(dropout.seed, counter, dropout.p)


def _expanded(a, groups, heads):
    """k or v (B, Hk, S, D) with the key/value head of each of `heads` query heads (a copy)."""
    return a[:, _kv_index(groups, heads)]


def _kv_index(groups, heads):
    return (numpy.arange(heads) + groups.offset) // groups.group


def _probabilities(q, k, causal, scale, lse=None):
    """float32 (B, H, T, S) softmax of the scaled, masked scores; with `lse` given, recomputed
    from it as the backward does. Returns (p, lse)."""
    f32 = numpy.float32
    scores = numpy.einsum("bhtd,bhsd->bhts", q.astype(f32), k.astype(f32)) * f32(scale)
    t, s = scores.shape[-2:]
    visible = numpy.arange(s)[None, :] <= numpy.arange(t)[:, None] + s - t if causal else \
        numpy.ones((t, s), dtype=bool)
    scores = numpy.where(visible, scores, -numpy.inf)
    if lse is None:
        m = scores.max(axis=-1, keepdims=True, initial=-numpy.inf)
        e = numpy.exp(scores - numpy.where(numpy.isfinite(m), m, f32(0)))
        total = e.sum(axis=-1, keepdims=True)
        with numpy.errstate(divide="ignore"):
            lse = numpy.where(total > 0, m + numpy.log(total), -numpy.inf)[..., 0]
        lse = numpy.ascontiguousarray(lse, dtype=f32)
    finite = numpy.isfinite(lse)[..., None]
    p = numpy.where(finite, numpy.exp(scores - numpy.where(finite, lse[..., None], f32(0))), 0)
    return p.astype(f32), lse


def _dropout_scale(dropout, shape):
    """float32 (B, H, T, S): 1/(1-p) where kept, 0 where dropped (1 without dropout)."""
    if dropout is None:
        return numpy.float32(1)
    return dropout_keep(dropout, shape) * numpy.float32(1 / (1 - dropout.p))


def _output_layout(array, dtype):
    out = numpy.empty((array.shape[0], array.shape[2], array.shape[1], array.shape[3]), dtype)
    out = out.transpose(0, 2, 1, 3)
    out[...] = array
    return out


def attention_forward_numpy(q, k, v, causal, scale, dropout=None, groups=None):
    groups = head_groups(q, k, groups)
    k, v = (_expanded(a, groups, q.shape[1]) for a in (k, v))
    p, lse = _probabilities(q, k, causal, scale)
    p = p * _dropout_scale(dropout, p.shape)
    o = numpy.einsum("bhts,bhsd->bhtd", p, v.astype(numpy.float32))
    return _output_layout(o, q.dtype), lse


def attention_backward_numpy(q, k, v, o, lse, do, causal, scale, dropout=None, groups=None):
    f32 = numpy.float32
    groups = head_groups(q, k, groups)
    kv_shape = k.shape
    k, v = (_expanded(a, groups, q.shape[1]) for a in (k, v))
    p, _ = _probabilities(q, k, causal, scale, lse)
    z = _dropout_scale(dropout, p.shape)
    dof = do.astype(f32)
    dv = numpy.einsum("bhts,bhtd->bhsd", p * z, dof)
    dp = numpy.einsum("bhtd,bhsd->bhts", dof, v.astype(f32)) * z
    delta = (dof * o.astype(f32)).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = numpy.einsum("bhts,bhsd->bhtd", ds, k.astype(f32)) * f32(scale)
    dk = numpy.einsum("bhts,bhtd->bhsd", ds, q.astype(f32)) * f32(scale)
    dk, dv = (_summed_over_groups(g, groups, kv_shape) for g in (dk, dv))
    return tuple(_output_layout(g, q.dtype) for g in (dq, dk, dv))


def _summed_over_groups(grad, groups, kv_shape):
    """float32 (B, Hk, S, D): each key/value head's sum of the gradients of its query heads."""
    out = numpy.zeros(kv_shape, numpy.float32)
    numpy.add.at(out, (slice(None), _kv_index(groups, grad.shape[1])), grad)
    return out
