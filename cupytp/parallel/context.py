"""Context parallelism: the sequence of every layer split across the ranks of a mesh dimension
("cp"), attention computed as a ring (ring attention, arXiv 2310.01889, as Megatron's and
torchtitan's context parallelism run it).

Layout: activations (B, T, C) are Shard(1) along cp and parameters Replicated there. Every op
but attention works token by token, so the layout rules carry them unchanged, and a parameter's
gradient, Partial along cp, is summed when it is accumulated, as along dp. Attention needs every
earlier key: `ContextParallel.attention` (q|k|v packed, GPT-2's) and `grouped_attention` (q, k
and v apart, fewer key/value heads than query heads: Llama's) pass the key/value blocks around
the ring of cp ranks; grouped-query blocks carry only the Hk key/value heads. At step s rank r
holds rank r−s's block, runs flash attention of its queries against it while the next block
travels (`ProcessGroup.sendrecv`, asynchronous), and merges the partial outputs exactly by their
log-sum-exp (`merge`). Backward walks the same ring: the key/value blocks again, each followed
by its gradient, which every rank it visits adds to, and which reaches its owner after cp steps.

Load balance: under a causal mask a contiguous split leaves the last rank the most work, so the
sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp−1−r (zigzag): every rank
does the same work. That permutes the tokens: `shard` puts a batch in the ring's order, and
`positions` gives the position ids that follow the permuted tokens (a model's position
embedding, or its rotary angles, read them); the loss, a mean over the tokens, does not depend
on their order. Uneven lengths: rank r's share of T (numpy.array_split over cp) is cut in two,
its first half chunk r and its second chunk 2·cp−1−r.

Per step and rank, the blocks of work follow from the ranks' segments of the sequence: a rank
with itself attends causally (its segments ascend, so the local order is the global one); with
another rank's block, each query segment sees that rank's segments that lie wholly before it, a
prefix of them. With the zigzag that is one block per step: all queries against the first half
of an earlier rank's keys, or the second half of the queries against all keys of a later rank.
"""
import math

import numpy

from cupytp import backend
from cupytp.launchers import compute_dtype, cudnn_attention, flash_attention
from cupytp.launchers.flash_attention import AttentionDropout, HeadGroups
from cupytp.nn.attention import GroupedQueryAttention
from cupytp.nn.layers import DAttention, Dropout, sequence_sharded
from cupytp.ops import packed_attention, scaled_dot_product_attention
from cupytp.ops.amp import autocast_operand
from cupytp.ops.conversion import (
    Partial, Replicated, Shard, convert, engine, fail, linear_grad, make)
from cupytp.ops.functional import unpacked
from cupytp.tensor.random import default_generator
from cupytp.distributed.process_group import split_sizes

ATTENTIONS = (DAttention, GroupedQueryAttention)      # the attentions `apply` makes rings of


# ---- the sequence's order -----------------------------------------------------------------------
def segments(length, parts, rank, load_balance=True):
    """The (start, stop) ranges of the global sequence that rank `rank` of `parts` holds, in its
    local order (ascending): the zigzag pair of chunks, or one contiguous range."""
    sizes = split_sizes(length, parts)
    if not load_balance:
        start = sum(sizes[:rank])
        return ((start, start + sizes[rank]),)
    firsts = [-(-n // 2) for n in sizes]                  # chunk r: the first half of share r
    seconds = [n - f for n, f in zip(sizes, firsts)]      # chunk 2·parts−1−r: the rest
    start = sum(firsts[:rank])
    second = sum(firsts) + sum(seconds[rank + 1:])
    return ((start, start + firsts[rank]), (second, second + seconds[rank]))


def positions_of(ranges):
    """The global positions of the tokens of `ranges`, in order (NumPy int64)."""
    if not ranges:
        return numpy.zeros(0, dtype=numpy.int64)
    return numpy.concatenate([numpy.arange(a, b, dtype=numpy.int64) for a, b in ranges])


def block_plan(query_ranges, key_ranges, causal):
    """The attention blocks of local queries held as `query_ranges` against keys held as
    `key_ranges`: [(row slice, column slice, causal)] of the local arrays, rows contiguous. Keys
    the same as the queries: one causal block (both ascend); keys of another rank: each query
    range sees the key ranges wholly before it (a prefix, since they ascend and are disjoint from
    it), consecutive query ranges seeing the same prefix in one block."""
    rows = sum(b - a for a, b in query_ranges)
    cols = sum(b - a for a, b in key_ranges)
    if not rows or not cols:
        return []
    if not causal:
        return [(slice(0, rows), slice(0, cols), False)]
    if tuple(query_ranges) == tuple(key_ranges):
        return [(slice(0, rows), slice(0, cols), True)]
    blocks, row = [], 0
    for a, b in query_ranges:
        seen = 0
        for ka, kb in key_ranges:
            if kb <= a:
                seen += kb - ka
            elif ka < b and kb > ka:
                raise ValueError(f"keys {ka}:{kb} overlap queries {a}:{b} of another rank")
        if seen and b > a:
            last = blocks[-1] if blocks else None
            if last is not None and last[0].stop == row and last[1].stop == seen:
                blocks[-1] = (slice(last[0].start, row + b - a), last[1], False)
            else:
                blocks.append((slice(row, row + b - a), slice(0, seen), False))
        row += b - a
    return blocks


# ---- local math of one block --------------------------------------------------------------------
def merge(o, lse, o_block, lse_block):
    """Fold a block's partial attention (o_block (..., T, D), lse_block (..., T)) into the
    running (o, lse), in place: o = (o·e^lse + o_block·e^lse_block) / e^lse_new with
    lse_new = log(e^lse + e^lse_block), exact. Rows that no key has reached (lse = −inf) take
    the block's values."""
    xp = backend.array_module(o)
    new = xp.logaddexp(lse, lse_block)
    seen = xp.isfinite(new)
    keep = xp.where(seen, xp.exp(lse - xp.where(seen, new, 0)), 0)[..., None]
    add = xp.where(seen, xp.exp(lse_block - xp.where(seen, new, 0)), 0)[..., None]
    o[...] = o * keep + o_block.astype(o.dtype, copy=False) * add
    lse[...] = new


class _Exact:
    """Block attention in `dtype` (the inputs' float dtype, float32 for 16-bit ones), the scores
    materialized: the dtypes and head sizes the flash kernels do not take (float64 tests), on
    NumPy or CuPy. Query head h reads key/value head (h + offset) // group of `groups` (a
    HeadGroups; None: as many heads as q's). Dropout is the block's AttentionDropout (its query
    and key positions given), drawn as the flash kernels draw it."""

    def __init__(self, dtype, groups=None):
        self.dtype, self.groups = dtype, groups

    def _heads(self, kv_heads, heads):
        """The key/value head of each local query head, or None where they are the same."""
        g = self.groups
        if g is None or (g.group == 1 and g.offset == 0 and kv_heads == heads):
            return None
        return (backend.xp.arange(heads) + g.offset) // g.group

    def _probabilities(self, q, k, causal, scale, lse=None):
        xp = backend.xp
        s = xp.einsum("bhtd,bhsd->bhts", q, k) * scale
        if causal:
            t, n = s.shape[-2:]
            hidden = xp.arange(n)[None, :] > xp.arange(t)[:, None] + n - t
            s = xp.where(hidden, -xp.inf, s)
        if lse is None:
            m = s.max(axis=-1, keepdims=True)
            e = xp.exp(s - m)
            total = e.sum(axis=-1, keepdims=True)
            return e / total, (m + xp.log(total))[..., 0]
        return xp.exp(s - lse[..., None]), lse

    def _scale(self, dropout, shape):
        """(B, H, T, S) 1/(1−p) where the block's dropout keeps, 0 where it drops; None without
        dropout."""
        if dropout is None:
            return None
        kept = flash_attention.dropout_mask(dropout, shape)
        return kept.astype(self.dtype) * self.dtype.type(1 / (1 - dropout.p))

    def forward(self, q, k, v, causal, scale, dropout):
        q, k, v = (a.astype(self.dtype, copy=False) for a in (q, k, v))
        keep = self._scale(dropout, q.shape[:3] + k.shape[2:3])
        index = self._heads(k.shape[1], q.shape[1])
        if index is not None:
            k, v = k[:, index], v[:, index]
        p, lse = self._probabilities(q, k, causal, scale)
        p = p if keep is None else p * keep
        return backend.xp.einsum("bhts,bhsd->bhtd", p, v), lse

    def backward(self, q, k, v, o, lse, do, causal, scale, dropout):
        xp = backend.xp
        q, k, v = (a.astype(self.dtype, copy=False) for a in (q, k, v))
        keep = self._scale(dropout, q.shape[:3] + k.shape[2:3])
        kv_heads = k.shape[1]
        index = self._heads(kv_heads, q.shape[1])
        if index is not None:
            k, v = k[:, index], v[:, index]
        p, _ = self._probabilities(q, k, causal, scale, lse)
        dp = xp.einsum("bhtd,bhsd->bhts", do, v)
        if keep is not None:
            dv = xp.einsum("bhts,bhtd->bhsd", p * keep, do)
            dp = dp * keep
        else:
            dv = xp.einsum("bhts,bhtd->bhsd", p, do)
        ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
        dq = xp.einsum("bhts,bhsd->bhtd", ds, k) * scale
        dk = xp.einsum("bhts,bhtd->bhsd", ds, q) * scale
        if index is not None:       # each key/value head sums the gradients of its group
            onehot = (index[:, None] == xp.arange(kv_heads)[None, :]).astype(dk.dtype)
            dk, dv = (xp.einsum("bhsd,hj->bjsd", a, onehot) for a in (dk, dv))
        return dq, dk, dv


class _Flash:
    """Block attention on the flash kernels (cuDNN's where they apply: without dropout), 16-bit
    inputs with head size 64 or 128, key/value heads read by `groups`; their NumPy twin on the
    CPU. Dropout: the block's AttentionDropout, its query and key positions given."""

    def __init__(self, groups=None):
        self.groups = groups

    def forward(self, q, k, v, causal, scale, dropout):
        return self._kernels(q, k, dropout, causal).attention_forward(
            q, k, v, causal, scale, dropout, groups=self.groups)

    def backward(self, q, k, v, o, lse, do, causal, scale, dropout):
        return self._kernels(q, k, dropout, causal).attention_backward(
            q, k, v, o, backend.xp.ascontiguousarray(lse), do, causal, scale, dropout,
            groups=self.groups)

    def _kernels(self, q, k, dropout, causal):
        """cuDNN's for the causal diagonal block and for the other ranks' blocks (unmasked,
        queries and keys of different lengths) where it applies, else the RawKernel's."""
        return cudnn_attention if cudnn_attention.applies(
            q, k, 0.0 if dropout is None else dropout.p, self.groups, causal) else \
            flash_attention


# ---- the ring -----------------------------------------------------------------------------------
class ContextParallel:
    """The sequence split across mesh dimension `dim` of `mesh`: tokens in zigzag order with
    `load_balance` (for causal attention), else contiguous.

    `shard(x)` lays a batch out (its sequence permuted and Shard(1) along cp), `positions(T)`
    gives their position ids, `apply(model)` makes every attention of a model run as the ring,
    and `attention(qkv, ...)` and `grouped_attention(q, k, v, ...)` are that ring."""

    def __init__(self, mesh, dim="cp", load_balance=True):
        if dim not in mesh.dim_names:
            raise ValueError(f"mesh {mesh} has no dimension {dim!r} to split the sequence over: "
                             f"name one (e.g. DeviceMesh((2, 2), ('cp', 'tp')))")
        self.mesh, self.dim = mesh, dim
        self.mesh_dim = mesh.dim_names.index(dim)
        self.group = mesh.get_process_group(dim)
        self.size, self.rank = self.group.size, self.group.rank
        self.load_balance = load_balance
        self._positions, self._orders, self._ring_positions = {}, {}, {}

    def __repr__(self):
        order = "zigzag" if self.load_balance else "contiguous"
        return f"ContextParallel({self.dim}={self.size}, {order})"

    # ---- the order ------------------------------------------------------------------------------
    def segments(self, length, rank=None):
        """The (start, stop) ranges of a sequence of `length` that cp rank `rank` (default this
        rank) holds, in its local order."""
        return segments(length, self.size, self.rank if rank is None else rank,
                        self.load_balance)

    def order(self, length):
        """The global position of each token of the permuted sequence, cp rank 0's first: the
        permutation `shard` applies (NumPy int64)."""
        return numpy.concatenate([positions_of(self.segments(length, r))
                                  for r in range(self.size)])

    def order_of(self, x):
        """The order of x's dimension 1 when x is sharded on it along cp (x came from
        `shard`): the global position of each of its indices (a device array); else None."""
        if self.size == 1 or x.ndim < 2 or x.placements[self.mesh_dim] != Shard(1):
            return None
        length = x.shape[1]
        if length not in self._orders:
            self._orders[length] = backend.asarray(self.order(length))
        return self._orders[length]

    def ring_positions(self, length):
        """The global positions of every cp rank's tokens (int64 device arrays, made once per
        length, so that a captured step copies nothing from the host): the ring's blocks draw
        their dropout by them."""
        if length not in self._ring_positions:
            self._ring_positions[length] = [backend.asarray(positions_of(self.segments(length, r)))
                                            for r in range(self.size)]
        return self._ring_positions[length]

    def _sharded(self, placements):
        return sequence_sharded(tuple(placements), self.mesh_dim, 1)

    def positions(self, length):
        """Position ids (length,) of the tokens `shard` gives this rank, Shard(0) along cp and
        Replicated elsewhere: what the model's position embedding (or rotary angles) reads."""
        if length not in self._positions:
            placements = sequence_sharded((Replicated(),) * self.mesh.ndim, self.mesh_dim, 0)
            local = backend.asarray(positions_of(self.segments(length)))
            self._positions[length] = make(local, self.mesh, (length,), placements)
        return self._positions[length]

    def shard(self, x):
        """`x` (B, T, ...), a batch whose sequence each rank holds whole (Replicated along cp),
        in the context-parallel layout: permuted into the ring's order and Shard(1) along cp.
        No communication: each rank keeps its own tokens. For data (ids, targets): nothing is
        recorded for autograd."""
        if x.mesh != self.mesh:
            raise ValueError(f"shard: the tensor lives on {x.mesh}, not on {self.mesh}")
        if x.ndim < 2 or any(p.is_shard(1) or p.is_partial() for p in x.placements):
            raise ValueError(f"shard takes a (B, T, ...) tensor whose sequence (dim 1) no mesh "
                             f"dimension shards, got {x.shape} as {x.placements}")
        local = backend.xp.take(x.to_local(), self.positions(x.shape[1]).to_local(), axis=1)
        return make(local, self.mesh, x.shape, self._sharded(x.placements))

    # ---- models ---------------------------------------------------------------------------------
    def apply(self, model):
        """Make every attention of `model` (DAttention, GroupedQueryAttention) run as this
        ring, and its dropout draw by token position; returns the model.
        Its parameters must live on this mesh, Replicated along cp (build it on the mesh:
        GPT2(config, mesh) shards over "tp"; or re-lay a dense one with
        parallelize_module(model, mesh, {}))."""
        for name, p in model.named_parameters():
            if p.mesh != self.mesh:
                raise ValueError(f"{name} lives on {p.mesh}, not on {self.mesh}: build the model "
                                 "on the mesh, or re-lay it with "
                                 "cupytp.parallel.parallelize_module(model, mesh, plan)")
            if p.placements[self.mesh_dim] != Replicated():
                raise ValueError(f"{name} is {p.placements[self.mesh_dim]} along {self.dim!r}: "
                                 "parameters are Replicated along the context-parallel "
                                 "dimension (a mesh without a 'tp' dimension gives its last "
                                 "dimension to tensor parallelism: name one 'tp', of size 1 if "
                                 "unused)")
        attentions = [m for m in model.modules() if isinstance(m, ATTENTIONS)]
        if not attentions:
            raise ValueError(f"{type(model).__name__} has no attention (DAttention or "
                             "GroupedQueryAttention) to run as a ring")
        for module in model.modules():
            if isinstance(module, ATTENTIONS + (Dropout,)):
                module.context_parallel = self
        return model

    def attention(self, qkv, causal=True, dropout_p=0.0, generator=None):
        """`ops.packed_attention` of qkv (B, T, 3, H, D) whose sequence is Shard(1) along cp (in
        this object's order), as a ring (module docstring): output (B, T, H, D) laid out like
        the queries. Batch Shard(0) and heads Shard(3) elsewhere need no communication. A qkv
        whose sequence is whole on every cp rank is plain `packed_attention`."""
        if self.size == 1 or qkv.ndim != 5 or qkv.placements[self.mesh_dim] != Shard(1):
            return packed_attention(qkv, causal, dropout_p, generator)
        _check_dropout(dropout_p)
        return _ring_attention(self, autocast_operand(qkv), causal, dropout_p, generator)

    def grouped_attention(self, q, k, v, causal=True, dropout_p=0.0, generator=None):
        """Attention of queries q (B, T, H, D) over keys and values k, v (B, T, Hk, D), Hk
        dividing H (query head h reads key/value head h // (H / Hk): grouped-query attention),
        their sequences Shard(1) along cp (in this object's order), as a ring whose travelling
        blocks hold the Hk key/value heads: output (B, T, H, D) laid out like q. Batch Shard(0)
        and heads Shard(2) elsewhere need no communication (k's and v's heads split alike where
        both head counts divide, else Replicated: each rank reads the heads its queries need).
        Sequences whole on every cp rank: plain `scaled_dot_product_attention`."""
        if self.size == 1 or q.ndim != 4 or q.placements[self.mesh_dim] != Shard(1):
            return scaled_dot_product_attention(*(a.transpose(1, 2) for a in (q, k, v)), causal,
                                                dropout_p, generator).transpose(1, 2)
        _check_dropout(dropout_p)
        if k.ndim != 4 or v.shape != k.shape or k.shape[2] == 0 or q.shape[2] % k.shape[2] or \
                q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]:
            raise ValueError(f"grouped ring attention takes q (B, T, H, D) and k, v (B, T, Hk, "
                             f"D) with Hk dividing H, got q {q.shape}, k {k.shape}, v {v.shape}")
        return _grouped_ring_attention(self, *(autocast_operand(a) for a in (q, k, v)), causal,
                                       dropout_p, generator)


def _check_dropout(p):
    if not 0 <= p < 1:
        raise ValueError(f"attention dropout probability must be in [0, 1), got {p}")


def _ring_layout(context, qkv):
    """(qkv's placements for the ring, the output's): Shard(1) along cp, batch Shard(0) and
    heads Shard(3) kept, anything else Replicated (a Partial qkv reduced)."""
    wanted, out = [], []
    for dim, p in enumerate(qkv.placements):
        if dim == context.mesh_dim:
            wanted.append(p)
            out.append(p)
        elif p in (Shard(0), Shard(3)):
            wanted.append(p)
            out.append(Shard(2) if p == Shard(3) else p)
        elif isinstance(p, Shard) and qkv.mesh.shape[dim] > 1:
            fail("ring attention", [qkv], f"mesh dimension {dim} shards dimension {p.dim}",
                 "Shard q|k|v (B, T, 3, H, D) on the batch (0) or heads (3) besides the "
                 "sequence along the context-parallel dimension; all-gather the rest.")
        else:
            wanted.append(Replicated())
            out.append(Replicated())
    return tuple(wanted), tuple(out)


def _grouped_layout(context, q, k, v):
    """(q's placements for the ring (the output's too), k's and v's, their gradients'): per
    mesh dimension Shard(1) along cp; batch Shard(0) kept; q's heads Shard(2) kept, k's and v's
    too where both head counts divide by that dimension's size, else Replicated (each rank
    reading the key/value heads its queries need, and giving its share of their gradient:
    Partial); anything else Replicated (a Partial input reduced)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    wanted_q, wanted_kv, grad_kv = [], [], []
    for dim, (p, size) in enumerate(zip(q.placements, q.mesh.shape)):
        if dim == context.mesh_dim or p == Shard(0):
            placements = (p, p, p)
        elif p == Shard(2):
            split = heads % size == 0 and kv_heads % size == 0
            placements = (p, p, p) if split else (p, Replicated(), Partial())
        elif isinstance(p, Shard) and size > 1:
            fail("ring attention", [q, k, v], f"mesh dimension {dim} shards dimension {p.dim}",
                 "Shard q (B, T, H, D), k and v on the batch (0) or heads (2) besides the "
                 "sequence along the context-parallel dimension; all-gather the rest.")
        else:
            placements = (Replicated(),) * 3
        for out, placement in zip((wanted_q, wanted_kv, grad_kv), placements):
            out.append(placement)
    return tuple(wanted_q), tuple(wanted_kv), tuple(grad_kv)


class _Ring:
    """What the forward and backward of one ring attention share: the kernels, the blocks of
    every step, the shapes of the blocks arriving, and the dropout's draws. `shape`: the
    queries' global (B, T, H, D); `q`: this rank's queries (B, H, T, D); `kv`: its keys and
    values (B, T, 2, Hk, D), the block that travels; `offsets`: its first (batch, query head);
    `groups`: the key/value head of each query head (HeadGroups; None: as many heads)."""

    def __init__(self, context, shape, q, kv, offsets, groups, causal, dropout_p, generator):
        b, t, h, d = shape
        self.context, self.causal = context, causal
        self.scale = 1.0 / math.sqrt(d)
        self.flash = flash_attention.supported(q, kv[:, :, 0], kv[:, :, 1]) and \
            cudnn_attention.choice() != "matmul"
        self.dtype = q.dtype
        self.acc = numpy.dtype(numpy.float32) if self.flash else compute_dtype(q.dtype)
        self.kernels = _Flash(groups) if self.flash else _Exact(self.acc, groups)
        n, r = context.size, context.rank
        ranges = [context.segments(t, j) for j in range(n)]
        self.steps = [((r - s) % n, block_plan(ranges[r], ranges[(r - s) % n], causal))
                      for s in range(n)]
        self.kv_shape = [(kv.shape[0], sum(e - a for a, e in ranges[j])) + kv.shape[2:]
                         for j in range(n)]
        self.positions = context.ring_positions(t)
        self.dropout = None
        if dropout_p > 0:
            seed, base, add = (generator or default_generator).philox_args((b, h, t, t))
            self.dropout = AttentionDropout(dropout_p, seed, base, add, h, *offsets,
                                            t_global=t, s_global=t)

    def block_dropout(self, rows, source, cols):
        """The dropout of this rank's queries `rows` against the keys `cols` of cp rank
        `source`: drawn by the global (b, h, t, s) index of each probability, as the attention
        of the whole sequence draws it (inside a micro-batch, `add` skips the batch's rows
        before it); None without dropout."""
        if self.dropout is None:
            return None
        return self.dropout._replace(rows=self.positions[self.context.rank][rows],
                                     cols=self.positions[source][cols])

    def pass_on(self, array, source, async_op=True):
        """Send `array` (the block of cp rank `source`, or its gradient) to the next rank;
        receive the previous rank's (rank source−1's block) in its place."""
        n, r = self.context.size, self.context.rank
        return self.context.group.sendrecv(array, (r + 1) % n, (r - 1) % n,
                                           shape=self.kv_shape[(source - 1) % n],
                                           async_op=async_op)

    def forward(self, q, kv):
        """(o (B, H, T, D) in the accumulation dtype, lse (B, H, T)) of this rank's queries q
        against every rank's keys and values, starting from its own `kv` (B, T, 2, Hk, D)."""
        xp = backend.xp
        o = lse = None
        for step, (source, blocks) in enumerate(self.steps):
            arriving = self.pass_on(kv, source) if step + 1 < len(self.steps) else None
            k, v = _heads_first(kv[:, :, 0]), _heads_first(kv[:, :, 1])
            for rows, cols, diagonal in blocks:
                o_block, lse_block = self.kernels.forward(
                    q[:, :, rows], k[:, :, cols], v[:, :, cols], diagonal, self.scale,
                    self.block_dropout(rows, source, cols))
                if o is None and _covers(rows, q.shape[2]):     # the first block: no merge
                    o, lse = (a.astype(self.acc, copy=False) for a in (o_block, lse_block))
                    continue
                if o is None:
                    o = xp.zeros(q.shape, dtype=self.acc)
                    lse = xp.full(q.shape[:3], -xp.inf, dtype=self.acc)
                merge(o[:, :, rows], lse[:, :, rows], o_block, lse_block)
            if arriving is not None:
                kv = arriving.wait()
        if o is None:                           # no key reached any query
            o, lse = xp.zeros(q.shape, dtype=self.acc), xp.full(q.shape[:3], -xp.inf, self.acc)
        return o, lse

    def backward(self, q, kv, o, lse, do):
        """(dq (B, H, T, D) in the accumulation dtype, the gradient (B, T, 2, Hk, D) of this
        rank's `kv` from every rank's queries): the blocks go around the ring again, each
        followed by its gradient, which every rank adds to and which is home after cp steps."""
        xp = backend.xp
        dq = None
        travelling = None                       # the gradient of the block in hand, in flight
        for step, (source, blocks) in enumerate(self.steps):
            arriving = self.pass_on(kv, source) if step + 1 < len(self.steps) else None
            k, v = _heads_first(kv[:, :, 0]), _heads_first(kv[:, :, 1])
            dkv = xp.zeros(kv.shape, dtype=self.acc)               # this rank's part of it
            for rows, cols, diagonal in blocks:
                dq_block, dk_block, dv_block = self.kernels.backward(
                    q[:, :, rows], k[:, :, cols], v[:, :, cols], o[:, :, rows],
                    lse[:, :, rows], do[:, :, rows], diagonal, self.scale,
                    self.block_dropout(rows, source, cols))
                if dq is None and _covers(rows, q.shape[2]):    # the first block: no sum
                    dq = dq_block.astype(self.acc, copy=False)
                else:
                    if dq is None:
                        dq = xp.zeros(q.shape, dtype=self.acc)
                    dq[:, :, rows] += dq_block
                dkv[:, cols, 0] += _heads_first(dk_block)
                dkv[:, cols, 1] += _heads_first(dv_block)
            if travelling is not None:
                dkv += travelling.wait()        # the parts of the ranks it visited before
            travelling = self.pass_on(dkv, source)
            if arriving is not None:
                kv = arriving.wait()
        if dq is None:
            dq = xp.zeros(q.shape, dtype=self.acc)
        return dq, travelling.wait()            # this rank's own block's, home after cp steps


def _covers(rows, length):
    """True when the slice `rows` spans all `length` rows."""
    return rows.indices(length) == (0, length, 1)


def _heads_first(a):
    """(B, T, H, D) → (B, H, T, D) view."""
    return a.transpose(0, 2, 1, 3)


def _ring_attention(context, qkv, causal, dropout_p, generator):
    """The ring over packed q|k|v (B, T, 3, H, D): one node, whose gradient is packed too."""
    wanted, out_placements = _ring_layout(context, qkv)
    qkv = convert("ring attention", qkv, wanted, [qkv])
    xp = backend.xp
    local = qkv.to_local()                                         # (B, T/cp, 3, H, D)
    q = unpacked(local)[0]                                         # (B, H, T/cp, D)
    kv = xp.ascontiguousarray(local[:, :, 1:])                     # (B, T/cp, 2, H, D): travels
    b, t, _, h, d = qkv.shape
    offsets = qkv.layout.offsets
    ring = _Ring(context, (b, t, h, d), q, kv, (offsets[0], offsets[3]), None, causal,
                 dropout_p, generator)
    o, lse = ring.forward(q, kv)                                   # kv: made again in backward
    result = xp.ascontiguousarray(_heads_first(o)).astype(ring.dtype, copy=False)  # (B, T, H, D)
    out = make(result, qkv.mesh, (b, t, h, d), out_placements)
    o_saved = _heads_first(result) if ring.flash else o

    def backward(g):
        g = linear_grad(g, out.placements, strict=range(len(g.placements)))
        do = _heads_first(g.to_local().astype(o_saved.dtype, copy=False))
        dq, dkv = ring.backward(q, xp.ascontiguousarray(local[:, :, 1:]), o_saved, lse, do)
        grad = xp.empty(local.shape, dtype=ring.dtype)
        grad[:, :, 0] = _heads_first(dq)
        grad[:, :, 1:] = dkv
        return (make(grad, qkv.mesh, qkv.shape, wanted),)
    return engine.record(out, (qkv,), backward, "ring_attention")


def _grouped_ring_attention(context, q, k, v, causal, dropout_p, generator):
    """The ring over queries (B, T, H, D) and keys and values (B, T, Hk, D): blocks of Hk heads
    travel, each query head reading its group's key/value head."""
    wanted_q, wanted_kv, grad_kv = _grouped_layout(context, q, k, v)
    inputs = [q, k, v]
    q = convert("ring attention", q, wanted_q, inputs)
    k, v = (convert("ring attention", a, wanted_kv, inputs) for a in (k, v))
    xp = backend.xp
    q_local = _heads_first(q.to_local())                           # (B, H, T/cp, D)
    kv = xp.stack([k.to_local(), v.to_local()], axis=2)            # (B, T/cp, 2, Hk, D)
    b, t, h, d = q.shape
    group = h // k.shape[2]
    offsets = q.layout.offsets
    groups = HeadGroups(group, offsets[2] - k.layout.offsets[2] * group)
    ring = _Ring(context, (b, t, h, d), q_local, kv, (offsets[0], offsets[2]), groups, causal,
                 dropout_p, generator)
    o, lse = ring.forward(q_local, kv)
    result = xp.ascontiguousarray(_heads_first(o)).astype(ring.dtype, copy=False)  # (B, T, H, D)
    out = make(result, q.mesh, q.shape, wanted_q)
    o_saved = _heads_first(result) if ring.flash else o
    kv_layout = k.layout

    def backward(g):
        g = linear_grad(g, out.placements, strict=range(len(g.placements)))
        do = _heads_first(g.to_local().astype(o_saved.dtype, copy=False))
        dq, dkv = ring.backward(q_local, kv, o_saved, lse, do)
        dkv = dkv.astype(ring.dtype, copy=False)
        dq = xp.ascontiguousarray(_heads_first(dq)).astype(ring.dtype, copy=False)
        return (make(dq, q.mesh, q.shape, wanted_q),
                *[make(dkv[:, :, i], kv_layout.mesh, kv_layout.shape, grad_kv) for i in (0, 1)])
    return engine.record(out, (q, k, v), backward, "ring_attention")


__all__ = ["ContextParallel", "segments", "positions_of", "block_plan", "merge"]
