"""Rotary position embeddings as an op (Hugging Face's rotate-half form, `kernels/rotary.cu`).

    rotary(x, cos, sin, start=0)

rotates x (B, T, H, D) pair by pair (i, i + D/2) by the angles of positions start, ...,
start + T - 1, read from the tables `cos` and `sin` (positions, D/2): local arrays of x's compute
dtype, the same on every rank (`nn.RotaryEmbedding` makes them). The rotation is linear and acts
within each (b, t, h): batch and heads may be sharded or Partial, T and D may not. The backward
rotates the gradient back (the rotation's transpose).
"""
from cupytp.launchers import rotary as kernel
from cupytp.ops.conversion import Replicated, Shard, backend, convert, engine, linear_grad, make


def rotary(x, cos, sin, start=0):
    """x rotated by the rotary embedding of positions start, ..., start + T - 1 (module
    docstring); a new tensor laid out like x."""
    if x.ndim != 4:
        raise ValueError(f"rotary takes (B, T, H, D), got shape {x.shape}")
    x = convert("rotary", x, tuple(Replicated() if p in (Shard(1), Shard(3)) else p
                                   for p in x.placements), [x])   # errs where that gathers
    layout = x.layout
    out = make(kernel.rotary(_rows_contiguous(x._local), cos, sin, start), layout.mesh,
               layout.shape, layout.placements)

    def backward(g):
        g = linear_grad(g, layout.placements)
        local = kernel.rotary(_rows_contiguous(g._local), cos, sin, start, inverse=True)
        return (make(local, layout.mesh, layout.shape, g.placements),)
    return engine.record(out, (x,), backward, "rotary")


def _rows_contiguous(a):
    """`a` itself when its last dimension is contiguous (the kernel reads strided rows), else a
    contiguous copy."""
    return a if a.strides[-1] == a.itemsize else backend.xp.ascontiguousarray(a)
