"""Rotary position embeddings as an op (Hugging Face's rotate-half form, `kernels/rotary.cu`).

    rotary(x, cos, sin, start=0)

rotates x (B, T, H, D) pair by pair (i, i + D/2) by the angles of its tokens' positions, read
from the tables `cos` and `sin` (positions, D/2): local arrays of x's compute dtype, the same on
every rank (`nn.RotaryEmbedding` makes them). `start` is the position of the first token (the
others follow: start, ..., start + T - 1), or a DTensor (T,) of every token's position (a
sequence in another order: context parallelism's, `ContextParallel.positions`), laid out as
x's sequence: Shard(0) where x is Shard(1), Replicated elsewhere. The rotation is linear and acts
within each (b, t, h): batch and heads may be sharded or Partial, and the sequence where its
positions are given alike; T without them and D may not. The backward rotates the gradient back
(the rotation's transpose).
"""
from cupytp.launchers import rotary as kernel
from cupytp.ops.conversion import (
    Replicated, Shard, backend, convert, engine, is_tensor, linear_grad, make)


def rotary(x, cos, sin, start=0):
    """x rotated by the rotary embedding of its tokens' positions (module docstring); a new
    tensor laid out like x."""
    if x.ndim != 4:
        raise ValueError(f"rotary takes (B, T, H, D), got shape {x.shape}")
    by_position = is_tensor(start)
    x = convert("rotary", x, tuple(
        Replicated() if p == Shard(3) or (p == Shard(1) and not by_position) else p
        for p in x.placements), [x])                                   # errs where that gathers
    cos, sin, start = tables_at(x, cos, sin, start)
    layout = x.layout
    out = make(kernel.rotary(_rows_contiguous(x._local), cos, sin, start), layout.mesh,
               layout.shape, layout.placements)

    def backward(g):
        g = linear_grad(g, layout.placements)
        local = kernel.rotary(_rows_contiguous(g._local), cos, sin, start, inverse=True)
        return (make(local, layout.mesh, layout.shape, g.placements),)
    return engine.record(out, (x,), backward, "rotary")


def tables_at(x, cos, sin, start):
    """(cos, sin, start) as the kernel reads them for x (B, T, ...): the tables and the first
    position, or for positions given as a DTensor (T,) this rank's tokens' rows of the tables
    (then start 0), the positions checked to be laid out as x's sequence."""
    if not is_tensor(start):
        return cos, sin, start
    positions = start
    if positions.ndim != 1 or positions.shape[0] != x.shape[1] or positions.mesh != x.mesh:
        raise ValueError(f"rotary: positions must be a (T,) tensor on x's mesh, one per token "
                         f"of x {x.shape}, got {positions.shape} on {positions.mesh}")
    wanted = tuple(Shard(0) if p == Shard(1) else Replicated() for p in x.placements)
    positions = convert("rotary", positions, wanted, [x, positions])
    rows = positions._local
    xp = backend.xp
    return xp.take(cos, rows, axis=0), xp.take(sin, rows, axis=0), 0


def _rows_contiguous(a):
    """`a` itself when its last dimension is contiguous (the kernel reads strided rows), else a
    contiguous copy."""
    return a if a.strides[-1] == a.itemsize else backend.xp.ascontiguousarray(a)
