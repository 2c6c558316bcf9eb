"""Contractions: `einsum` over two operands, and `matmul` as one of its forms.

Rule, per mesh dimension, by the letter a shard sits on: both operands sharded on the same
contracted letter gives Partial (the lazy all-reduce of row-parallel layers); a shard on a kept
letter gives a Shard of that output letter, the other operand sliced if it has the letter too
(column-parallel: R @ S(-1) -> S(-1)); one Partial operand with the other Replicated stays
Partial (linear); shards on two different letters have no rule. The gradients are einsums
themselves, so their layouts (a Partial input gradient of a column-parallel layer, say) follow
from the same rule.
"""
import functools
import math
import string

from cupytp.ops.conversion import (
    Partial, Replicated, Shard, backend, cached, convert, engine, fail, make, redistribute,
    same_mesh)
from cupytp.tensor.redistribute import grad_placements
from cupytp.ops.amp import autocast_operand, master_cast
from cupytp.ops.elementwise import astype


def _parse(spec, a, b):
    return _parse_shapes(spec, a.shape, b.shape)


@functools.lru_cache(maxsize=4096)
def _parse_shapes(spec, shape_a, shape_b):
    try:
        inputs, out = spec.replace(" ", "").split("->")
        sa, sb = inputs.split(",")
    except ValueError:
        raise ValueError(f"einsum spec {spec!r} is not of the form 'ab,bc->ac'") from None
    for name, letters, shape in (("first", sa, shape_a), ("second", sb, shape_b)):
        if len(letters) != len(shape) or len(set(letters)) != len(letters):
            raise ValueError(f"einsum {spec!r}: {name} operand has shape {shape}, the spec "
                             f"gives it {letters!r}")
    for letter in sa + sb:
        if letter not in out and (letter not in sa or letter not in sb):
            raise ValueError(f"einsum {spec!r}: letter {letter!r} of one operand is summed "
                             "alone; sum it first with .sum()")
    sizes = {}
    for letters, shape in ((sa, shape_a), (sb, shape_b)):
        for letter, n in zip(letters, shape):
            if sizes.setdefault(letter, n) != n:
                raise ValueError(f"einsum {spec!r}: letter {letter!r} has sizes {sizes[letter]} "
                                 f"and {n}")
    return sa, sb, out, tuple(sizes[letter] for letter in out)


def _rule(spec, sa, sb, out, a, b):
    targets_a, targets_b, placements = list(a.placements), list(b.placements), []
    for dim in range(a.mesh.ndim):
        pa, pb = a.placements[dim], b.placements[dim]
        letters = {sa[p.dim] if isinstance(p, Shard) else None for p, sa in ((pa, sa), (pb, sb))}
        letters.discard(None)
        if len(letters) > 1:
            fail(f"einsum {spec!r}", [a, b], f"mesh dimension {dim} shards letters "
                 f"{sorted(letters)}", f"Call .redistribute(...) with Replicated() on mesh "
                 f"dimension {dim} for one operand first.")
        if letters:
            letter = letters.pop()
            targets_a[dim] = Shard(sa.index(letter)) if letter in sa else Replicated()
            targets_b[dim] = Shard(sb.index(letter)) if letter in sb else Replicated()
            placements.append(Shard(out.index(letter)) if letter in out else Partial())
        elif (pa.is_partial() and pb.is_replicated() and pa.op == "sum") or \
                (pb.is_partial() and pa.is_replicated() and pb.op == "sum"):
            placements.append(Partial())
        else:
            targets_a[dim] = targets_b[dim] = Replicated()
            placements.append(Replicated())
    return tuple(targets_a), tuple(targets_b), tuple(placements)


def _matmul_transposes(sa, sb, out):
    """(transpose x?, transpose y?) when `sa,sb->out` is the batched matmul of x and y (each
    possibly transposed), else None."""
    if len(out) < 2 or len(sa) != len(out):
        return None
    batch, (m, n) = out[:-2], out[-2:]
    k = ({*sa[-2:]} & {*sb[-2:]}) - {m, n}
    if sa[:-2] != batch or not batch.endswith(sb[:-2]) or len(k) != 1:
        return None
    k = k.pop()
    if {*sa[-2:]} != {m, k} or {*sb[-2:]} != {k, n}:
        return None
    return sa[-2:] != m + k, sb[-2:] != k + n


def _matmul(x, y, out_dtype=None, shape=None):
    """Local matmul: on the GPU through cuBLAS called directly (launchers.gemm: bf16 with fp32
    accumulation, and legal inside a CUDA-graph capture); NumPy's otherwise. `out_dtype`:
    float32 for 16-bit operands (the sums unrounded), else None. `shape`: the result's shape, a
    reshape of the product (on the GPU made with it, not as a view: a gradient nothing else
    holds is then handed to its leaf without a copy)."""
    if x.dtype != y.dtype:          # NumPy's promotion, as numpy.matmul would do
        dtype = backend.xp.result_type(x.dtype, y.dtype)
        x, y = x.astype(dtype, copy=False), y.astype(dtype, copy=False)
    if backend.on_gpu:
        from cupytp.launchers.gemm import matmul
        return matmul(x, y, out_dtype, shape)
    if shape is not None:
        return _matmul(x, y, out_dtype).reshape(shape)
    if x.dtype.itemsize == 2:
        from cupytp.launchers.gemm import matmul_numpy
        return matmul_numpy(x, y, out_dtype)
    return backend.xp.matmul(x, y)


def _tensordot(x, y, axes_x, axes_y, out_dtype=None):
    """tensordot; on the GPU and for bfloat16, as one matmul of x as (kept, contracted) and y as
    (contracted, kept). Contracted axes that lead or trail in order on a contiguous operand are
    a reshape (a transposed view where needed, which cuBLAS reads in place); only other axis
    orders are copied."""
    if not backend.on_gpu and x.dtype.itemsize != 2:
        return backend.xp.tensordot(x, y, axes=(axes_x, axes_y))
    a, b, shape = _tensordot_operands(x, y, axes_x, axes_y)
    return _matmul(a, b, out_dtype, shape)


def _tensordot_operands(x, y, axes_x, axes_y):
    """(x as a matrix, y as a matrix, the result's shape) of tensordot as one matmul."""
    keep_x = [d for d in range(x.ndim) if d not in axes_x]
    keep_y = [d for d in range(y.ndim) if d not in axes_y]
    inner = math.prod(x.shape[d] for d in axes_x)
    return (_as_matrix(x, list(axes_x), contracted_last=True, inner=inner),
            _as_matrix(y, list(axes_y), contracted_last=False, inner=inner),
            tuple([x.shape[d] for d in keep_x] + [y.shape[d] for d in keep_y]))


def _as_matrix(v, axes, contracted_last, inner):
    """`v` as a 2-D (kept, contracted) matrix (or (contracted, kept)), as a view when the
    contracted axes lead or trail in order and v is contiguous, else as a copy."""
    xp = backend.xp
    n = v.ndim
    keep = [d for d in range(n) if d not in axes]
    kept = math.prod(v.shape[d] for d in keep)       # no -1: an empty shard's sizes are known
    leading, trailing = axes == list(range(len(axes))), axes == list(range(n - len(axes), n))
    if backend.c_contiguous(v) and (leading or trailing):
        flat = v.reshape(inner, kept) if leading else v.reshape(kept, inner)
        return flat if leading != contracted_last else flat.T
    order = keep + axes if contracted_last else axes + keep
    matrix = xp.ascontiguousarray(xp.transpose(v, order))
    return matrix.reshape(kept, inner) if contracted_last else matrix.reshape(inner, kept)


@functools.lru_cache(maxsize=4096)
def _contraction(sa, sb, out):
    """How `sa,sb->out` runs locally: ("tensordot", swap, axes of the first, axes of the second,
    output permutation or None), ("matmul", swap, transpose first?, transpose second?) or
    ("einsum",); `swap`: y goes first."""
    shared = [letter for letter in sa if letter in sb]
    if not any(letter in out for letter in shared):
        free = "".join(letter for letter in sa + sb if letter not in shared)
        if sorted(out) == sorted(free):
            axes_x, axes_y = [sa.index(c) for c in shared], [sb.index(c) for c in shared]
            swapped = "".join(letter for letter in sb + sa if letter not in shared)
            if out == swapped and out != free:        # y's kept letters first: yᵀ-side product
                return "tensordot", True, axes_y, axes_x, None
            return ("tensordot", False, axes_x, axes_y,
                    None if out == free else [free.index(c) for c in out])
    for swap, (first, second) in enumerate(((sa, sb), (sb, sa))):
        transposes = _matmul_transposes(first, second, out)
        if transposes is not None:
            return ("matmul", bool(swap)) + transposes
    return ("einsum",)


def local_einsum(sa, sb, out, x, y, out_dtype=None):
    """The local contraction through BLAS: a tensordot when nothing shared is kept, a (batched,
    possibly transposed or swapped) matmul; einsum only for anything else. `out_dtype`: a wider
    float dtype to write the result in (float32 sums of 16-bit operands unrounded). On the GPU a
    contraction that reads both operands in place runs the cuBLAS product planned for its
    signature (spec, shapes, strides, dtypes) the first time it was seen."""
    if backend.on_gpu:
        key = (sa, sb, out, x.shape, x.strides, y.shape, y.strides, x.dtype, y.dtype, out_dtype)
        planned = _products.get(key)
        if planned is None:
            if len(_products) >= 4096:
                _products.clear()
            planned = _products[key] = _plan_product(sa, sb, out, x, y, out_dtype)
        if planned:
            product, swap, perm = planned
            result = product.run(*((y.data.ptr, x.data.ptr) if swap else
                                   (x.data.ptr, y.data.ptr)))
            return result if perm is None else backend.xp.transpose(result, perm)
    xp = backend.xp
    plan = _contraction(sa, sb, out)
    wide = _wide(x, out_dtype)
    if _not_one_product(plan, x, wide):
        result = xp.einsum(f"{sa},{sb}->{out}", x, y) if plan[0] == "einsum" else \
            local_einsum(sa, sb, out, x, y)
        return result if wide is None else result.astype(wide)
    first, second = (y, x) if plan[1] else (x, y)
    if plan[0] == "matmul":
        return _matmul(*_matmul_operands(plan, first, second), wide)
    result = _tensordot(first, second, plan[2], plan[3], wide)
    return result if plan[4] is None else xp.transpose(result, plan[4])


_products = {}      # contraction signature -> (gemm.Product, swap, permutation) or False


def _wide(x, out_dtype):
    return out_dtype if out_dtype is not None and out_dtype != x.dtype else None


def _not_one_product(plan, x, wide):
    """True for a contraction that is not one BLAS product of x's dtype: an einsum, or a wider
    output other than the float32 sums of 16-bit operands."""
    return plan[0] == "einsum" or (
        wide is not None and (wide != backend.xp.float32 or x.dtype.itemsize != 2))


def _matmul_operands(plan, first, second):
    xp = backend.xp
    return (xp.swapaxes(first, -1, -2) if plan[2] else first,
            xp.swapaxes(second, -1, -2) if plan[3] else second)


def _plan_product(sa, sb, out, x, y, out_dtype):
    """(gemm.Product, swap, output permutation) running `sa,sb->out` on arrays like x and y
    with one cuBLAS call reading both in place, else False (the general path serves)."""
    from cupytp.launchers.gemm import product
    plan = _contraction(sa, sb, out)
    wide = _wide(x, out_dtype)
    if _not_one_product(plan, x, wide) or x.dtype != y.dtype:
        return False
    first, second = (y, x) if plan[1] else (x, y)
    if plan[0] == "matmul":
        a, b, shape, perm = *_matmul_operands(plan, first, second), None, None
    else:
        (a, b, shape), perm = _tensordot_operands(first, second, plan[2], plan[3]), plan[4]
    if a.data.ptr != first.data.ptr or b.data.ptr != second.data.ptr:
        return False                # an operand was copied: not read in place
    made = product(a, b, wide, shape)
    return False if made is None else (made, plan[1], perm)


def _operand(spec, x, targets, operands):
    """(the operand the contraction reads, the input it records): a parameter inside autocast is
    read through its unrecorded cast and recorded itself (its gradient comes in its own dtype)
    when it needs no redistribution; anything else is cast (recorded) and converted."""
    if targets == x.placements:
        cast = master_cast(x)
        if cast is not None:
            return cast, x
    x = convert(f"einsum {spec!r}", autocast_operand(x), targets, operands)
    return x, x


def einsum(spec, a, b, out_dtype=None, reduce_input_grad=False):
    """Two-operand einsum with explicit letters, e.g. 'btc,cd->btd' or 'bhtd,bhsd->bhts'.
    `out_dtype`: a wider float dtype for the result (the fp32 sums of 16-bit operands).
    `reduce_input_grad`: the product is a column-parallel layer's. In backward a Partial
    gradient of `a` (its Replicated input) is reduced here, on the communication stream while
    b's gradient (the weight's) is computed, instead of by whatever op consumes it later. An
    `a` sharded on a kept letter of its own (the sequence) along a mesh dimension where b
    shards its output letter (sequence parallelism) is all-gathered there first, after
    autocast's cast, and its gradient is reduce-scattered back to a's layout."""
    same_mesh("einsum", [a, b])
    sa, sb, out, shape = _parse(spec, a, b)
    gathered = None
    if reduce_input_grad:
        gather = _sequence_gather(sa, sb, out, a.placements, b.placements)
        if gather is not None:
            gathered = grad_placements(a.placements)
            a = autocast_operand(a).redistribute(gather)
    targets_a, targets_b, placements = cached(
        (_rule, spec, a.shape, a.placements, b.shape, b.placements), _rule, spec, sa, sb, out, a, b)
    a, input_a = _operand(spec, a, targets_a, [a, b])
    b, input_b = _operand(spec, b, targets_b, [a, b])
    local = local_einsum(sa, sb, out, a._local, b._local, out_dtype)
    result = make(local, a.mesh, shape, placements)
    dtype = result.dtype if out_dtype is None else a.dtype   # a dtype: the tape keeps no values
    a_dtype, b_dtype = input_a.dtype, input_b.dtype
    a_grad_placements = None if not reduce_input_grad else \
        gathered or grad_placements(input_a.placements)

    def backward(g, needs=None):
        g = astype(g, dtype)
        grad_a = grad_b = reducing = None
        if input_a.requires_grad if needs is None else needs[0]:
            grad_a = einsum(f"{out},{sb}->{sa}", g, b, a_dtype)
            if a_grad_placements is not None and grad_a.placements != a_grad_placements:
                reducing = redistribute(grad_a, a_grad_placements, async_op=True)
        if input_b.requires_grad if needs is None else needs[1]:
            grad_b = einsum(f"{sa},{out}->{sb}", a, g, b_dtype)
        if reducing is not None:
            grad_a = reducing.wait()
        return grad_a, grad_b
    return engine.record(result, (input_a, input_b), backward, "einsum", splits=True)


@functools.lru_cache(maxsize=4096)
def _sequence_gather(sa, sb, out, placements_a, placements_b):
    """The placements a column-parallel product all-gathers its input `a` to (Replicated on the
    mesh dims where a shards a kept letter b lacks and b a kept letter a lacks: a
    sequence-sharded input meeting column-sharded weights), or None when none does."""
    gather = list(placements_a)
    for dim, (pa, pb) in enumerate(zip(placements_a, placements_b)):
        if isinstance(pa, Shard) and isinstance(pb, Shard):
            own_a, own_b = sa[pa.dim], sb[pb.dim]
            if own_a in out and own_a not in sb and own_b in out and own_b not in sa:
                gather[dim] = Replicated()
    return tuple(gather) if gather != list(placements_a) else None


def column_input(spec, a, b):
    """`a` as the input of several column-parallel products `spec` with weights laid out like
    `b` (q and k|v of one attention, say): all-gathered on its sequence where
    `einsum(spec, a, b, reduce_input_grad=True)` would gather it (sequence parallelism), after
    autocast's cast, in one recorded redistribution. The products then run without
    `reduce_input_grad`: their Partial gradients are summed by the engine and reduced once, by
    this redistribution's backward (a reduce-scatter back to a's layout, or an all-reduce),
    instead of once per product."""
    sa, sb, out, _ = _parse(spec, a, b)
    gather = _sequence_gather(sa, sb, out, a.placements, b.placements)
    return autocast_operand(a).redistribute(gather or grad_placements(a.placements))


def matmul(a, b, reduce_input_grad=False):
    """`a @ b` for a of shape (..., m, k) and b of shape (k, n) or (..., k, n);
    `reduce_input_grad` as in `einsum`."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs operands of 2 or more dimensions, got {a.shape} and "
                         f"{b.shape}")
    if b.ndim > a.ndim or (b.ndim > 2 and b.shape[:-2] != a.shape[a.ndim - b.ndim:-2]):
        raise ValueError(f"matmul: batch dimensions of {b.shape} must match those of {a.shape}")
    return einsum(_matmul_spec(a.ndim, b.ndim), a, b, reduce_input_grad=reduce_input_grad)


@functools.lru_cache(maxsize=64)
def _matmul_spec(ndim_a, ndim_b):
    """The einsum spec of `a @ b`: 'abxy,byz->abxz' for 4-D a and 3-D b."""
    batch = string.ascii_lowercase[:ndim_a - 2]
    m, k, n = "x", "y", "z"
    sb = batch[len(batch) - (ndim_b - 2):] + k + n if ndim_b > 2 else k + n
    return f"{batch}{m}{k},{sb}->{batch}{m}{n}"
