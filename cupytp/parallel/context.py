"""Context parallelism: the sequence of every layer split across the ranks of a mesh dimension
("cp"), attention computed as a ring (ring attention, arXiv 2310.01889, as Megatron's and
torchtitan's context parallelism run it).

Layout: activations (B, T, C) are Shard(1) along cp and parameters Replicated there. Every op
but attention works token by token, so the layout rules carry them unchanged, and a parameter's
gradient, Partial along cp, is summed when it is accumulated, as along dp. Attention needs every
earlier key: `ContextParallel.attention` passes the key/value blocks around the ring of cp ranks.
At step s rank r holds rank r−s's block, runs flash attention of its queries against it while
the next block travels (`ProcessGroup.sendrecv`, asynchronous), and merges the partial outputs
exactly by their log-sum-exp (`merge`). Backward walks the same ring: the key/value blocks
again, each followed by its gradient, which every rank it visits adds to, and which reaches its
owner after cp steps.

Load balance: under a causal mask a contiguous split leaves the last rank the most work, so the
sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp−1−r (zigzag): every rank
does the same work. That permutes the tokens: `shard` puts a batch in the ring's order, and
`positions` gives the position ids that follow the permuted tokens; the loss, a mean over the
tokens, does not depend on their order. Uneven lengths: rank r's share of T (numpy.array_split
over cp) is cut in two, its first half chunk r and its second chunk 2·cp−1−r.

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
from cupytp.nn.layers import DAttention, Dropout, sequence_sharded
from cupytp.ops import packed_attention
from cupytp.ops.amp import autocast_operand
from cupytp.ops.conversion import Replicated, Shard, convert, engine, fail, linear_grad, make
from cupytp.ops.functional import unpacked
from cupytp.launchers.philox import uniform_at
from cupytp.tensor.random import default_generator
from cupytp.distributed.process_group import split_sizes


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
    NumPy or CuPy. Dropout is a (B, H, T, S) array of 1/(1−p) where kept, 0 where dropped."""

    def __init__(self, dtype):
        self.dtype = dtype

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

    def forward(self, q, k, v, causal, scale, keep):
        q, k, v = (a.astype(self.dtype, copy=False) for a in (q, k, v))
        p, lse = self._probabilities(q, k, causal, scale)
        p = p if keep is None else p * keep
        return backend.xp.einsum("bhts,bhsd->bhtd", p, v), lse

    def backward(self, q, k, v, o, lse, do, causal, scale, keep):
        xp = backend.xp
        q, k, v = (a.astype(self.dtype, copy=False) for a in (q, k, v))
        p, _ = self._probabilities(q, k, causal, scale, lse)
        dp = xp.einsum("bhtd,bhsd->bhts", do, v)
        if keep is not None:
            dv = xp.einsum("bhts,bhtd->bhsd", p * keep, do)
            dp = dp * keep
        else:
            dv = xp.einsum("bhts,bhtd->bhsd", p, do)
        ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
        return (xp.einsum("bhts,bhsd->bhtd", ds, k) * scale,
                xp.einsum("bhts,bhtd->bhsd", ds, q) * scale, dv)


class _Flash:
    """Block attention on the flash kernels (cuDNN's where they apply), 16-bit inputs with head
    size 64 or 128; their NumPy twin on the CPU. No dropout."""

    def forward(self, q, k, v, causal, scale, keep):
        return self._kernels(q, k).attention_forward(q, k, v, causal, scale)

    def backward(self, q, k, v, o, lse, do, causal, scale, keep):
        return self._kernels(q, k).attention_backward(
            q, k, v, o, backend.xp.ascontiguousarray(lse), do, causal, scale)

    @staticmethod
    def _kernels(q, k):
        return cudnn_attention if cudnn_attention.applies(q, k, 0.0) else flash_attention


# ---- the ring -----------------------------------------------------------------------------------
class ContextParallel:
    """The sequence split across mesh dimension `dim` of `mesh`: tokens in zigzag order with
    `load_balance` (for causal attention), else contiguous.

    `shard(x)` lays a batch out (its sequence permuted and Shard(1) along cp), `positions(T)`
    gives their position ids, `apply(model)` makes every attention of a model run as the ring,
    and `attention(qkv, ...)` is that ring."""

    def __init__(self, mesh, dim="cp", load_balance=True):
        if dim not in mesh.dim_names:
            raise ValueError(f"mesh {mesh} has no dimension {dim!r} to split the sequence over: "
                             f"name one (e.g. DeviceMesh((2, 2), ('cp', 'tp')))")
        self.mesh, self.dim = mesh, dim
        self.mesh_dim = mesh.dim_names.index(dim)
        self.group = mesh.get_process_group(dim)
        self.size, self.rank = self.group.size, self.group.rank
        self.load_balance = load_balance
        self._positions, self._orders = {}, {}

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
        """Make every attention of `model` (a DAttention) run as this ring, and its dropout draw
        by token position; returns the model.
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
        attentions = [m for m in model.modules() if isinstance(m, DAttention)]
        if not attentions:
            raise ValueError(f"{type(model).__name__} has no attention (DAttention) to run as a "
                             "ring")
        for module in model.modules():
            if isinstance(module, (DAttention, Dropout)):
                module.context_parallel = self
        return model

    def attention(self, qkv, causal=True, dropout_p=0.0, generator=None):
        """`ops.packed_attention` of qkv (B, T, 3, H, D) whose sequence is Shard(1) along cp (in
        this object's order), as a ring (module docstring): output (B, T, H, D) laid out like
        the queries. Batch Shard(0) and heads Shard(3) elsewhere need no communication. A qkv
        whose sequence is whole on every cp rank is plain `packed_attention`."""
        if self.size == 1 or qkv.ndim != 5 or qkv.placements[self.mesh_dim] != Shard(1):
            return packed_attention(qkv, causal, dropout_p, generator)
        if not 0 <= dropout_p < 1:
            raise ValueError(f"attention dropout probability must be in [0, 1), got "
                             f"{dropout_p}")
        return _ring_attention(self, autocast_operand(qkv), causal, dropout_p, generator)


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


class _Ring:
    """What the forward and backward of one ring attention share: the kernels, the blocks of
    every step, the shapes of the blocks arriving, and the dropout's draws."""

    def __init__(self, context, qkv, causal, dropout_p, generator):
        b, t, _, h, d = qkv.shape
        local = qkv.to_local()
        self.context, self.causal = context, causal
        self.scale = 1.0 / math.sqrt(d)
        self.flash = flash_attention.supported(*unpacked(local)) and \
            cudnn_attention.choice() != "matmul"
        if self.flash and dropout_p > 0:
            raise ValueError("attention dropout under context parallelism runs only off the "
                             "flash kernels (their dropout draws by the position in one "
                             "block): set the attention dropout to 0, or CUPYTP_ATTENTION=matmul")
        self.dtype = local.dtype
        self.acc = numpy.dtype(numpy.float32) if self.flash else compute_dtype(local.dtype)
        self.kernels = _Flash() if self.flash else _Exact(self.acc)
        self.local_bh = (local.shape[0], local.shape[3])
        n, r = context.size, context.rank
        ranges = [context.segments(t, j) for j in range(n)]
        self.steps = [((r - s) % n, block_plan(ranges[r], ranges[(r - s) % n], causal))
                      for s in range(n)]
        self.kv_shape = [(local.shape[0], sum(e - a for a, e in ranges[j]), 2) + local.shape[3:]
                         for j in range(n)]
        self.positions = [backend.asarray(positions_of(ranges[j])) for j in range(n)]
        self.dropout = None
        if dropout_p > 0:
            seed, base, add = (generator or default_generator).philox_args((b, h, t, t))
            offsets = qkv.layout.offsets
            self.dropout = (dropout_p, seed, base, add, (b, h, t), offsets[0], offsets[3])

    def keep(self, rows, source, cols):
        """The dropout's (B, H, rows, cols) scale of this rank's queries `rows` against the keys
        `cols` of cp rank `source`: drawn by the global (b, h, t, s) index of the probability,
        as the attention of the whole sequence draws it (inside a micro-batch, `add` skips the
        batch's rows before it)."""
        if self.dropout is None:
            return None
        xp = backend.xp
        p, seed, base, add, (b, h, t), batch0, head0 = self.dropout
        lb, lh = self.local_bh
        u64 = xp.uint64
        bh = (xp.arange(batch0, batch0 + lb, dtype=u64)[:, None] * u64(h)
              + xp.arange(head0, head0 + lh, dtype=u64)[None, :])          # (B, H)
        query = self.positions[self.context.rank][rows].astype(u64)
        key = self.positions[source][cols].astype(u64)
        index = ((bh[:, :, None] * u64(t) + query[None, None, :])[..., None] * u64(t)
                 + key[None, None, None, :])
        drawn = uniform_at(seed, index + (base + u64(add)))
        return (drawn >= p).astype(self.acc) * self.acc.type(1 / (1 - p))

    def pass_on(self, array, source, async_op=True):
        """Send `array` (the block of cp rank `source`, or its gradient) to the next rank;
        receive the previous rank's (rank source−1's block) in its place."""
        n, r = self.context.size, self.context.rank
        return self.context.group.sendrecv(array, (r + 1) % n, (r - 1) % n,
                                           shape=self.kv_shape[(source - 1) % n],
                                           async_op=async_op)


def _heads_first(a):
    """(B, T, H, D) → (B, H, T, D) view."""
    return a.transpose(0, 2, 1, 3)


def _ring_attention(context, qkv, causal, dropout_p, generator):
    wanted, out_placements = _ring_layout(context, qkv)
    qkv = convert("ring attention", qkv, wanted, [qkv])
    ring = _Ring(context, qkv, causal, dropout_p, generator)
    xp = backend.xp
    local = qkv.to_local()                                         # (B, T/cp, 3, H, D)
    q = unpacked(local)[0]                                         # (B, H, T/cp, D)
    kv = xp.ascontiguousarray(local[:, :, 1:])                     # (B, T/cp, 2, H, D): travels
    o = xp.zeros(q.shape, dtype=ring.acc)
    lse = xp.full(q.shape[:3], -xp.inf, dtype=ring.acc)
    for step, (source, blocks) in enumerate(ring.steps):
        arriving = ring.pass_on(kv, source) if step + 1 < len(ring.steps) else None
        k, v = _heads_first(kv[:, :, 0]), _heads_first(kv[:, :, 1])
        for rows, cols, diagonal in blocks:
            o_block, lse_block = ring.kernels.forward(
                q[:, :, rows], k[:, :, cols], v[:, :, cols], diagonal, ring.scale,
                ring.keep(rows, source, cols))
            merge(o[:, :, rows], lse[:, :, rows], o_block, lse_block)
        if arriving is not None:
            kv = arriving.wait()
    result = xp.ascontiguousarray(_heads_first(o)).astype(ring.dtype, copy=False)  # (B, T, H, D)
    b, t, _, h, d = qkv.shape
    out = make(result, qkv.mesh, (b, t, h, d), out_placements)
    o_saved = _heads_first(result) if ring.flash else o

    def backward(g):
        g = linear_grad(g, out.placements)
        do = _heads_first(g.to_local().astype(o_saved.dtype, copy=False))
        dq = xp.zeros(q.shape, dtype=ring.acc)
        kv = xp.ascontiguousarray(local[:, :, 1:])
        travelling = None                       # the gradient of the block in hand, in flight
        for step, (source, blocks) in enumerate(ring.steps):
            arriving = ring.pass_on(kv, source) if step + 1 < len(ring.steps) else None
            k, v = _heads_first(kv[:, :, 0]), _heads_first(kv[:, :, 1])
            dkv = xp.zeros(kv.shape, dtype=ring.acc)               # this rank's part of it
            for rows, cols, diagonal in blocks:
                dq_block, dk_block, dv_block = ring.kernels.backward(
                    q[:, :, rows], k[:, :, cols], v[:, :, cols], o_saved[:, :, rows],
                    lse[:, :, rows], do[:, :, rows], diagonal, ring.scale,
                    ring.keep(rows, source, cols))
                dq[:, :, rows] += dq_block
                dkv[:, cols, 0] += _heads_first(dk_block)
                dkv[:, cols, 1] += _heads_first(dv_block)
            if travelling is not None:
                dkv += travelling.wait()        # the parts of the ranks it visited before
            travelling = ring.pass_on(dkv, source)
            if arriving is not None:
                kv = arriving.wait()
        grad = xp.empty(local.shape, dtype=ring.dtype)
        grad[:, :, 0] = _heads_first(dq)
        grad[:, :, 1:] = travelling.wait()      # this rank's own block, home after cp steps
        return (make(grad, qkv.mesh, qkv.shape, wanted),)
    return engine.record(out, (qkv,), backward, "ring_attention")


__all__ = ["ContextParallel", "segments", "positions_of", "block_plan", "merge"]
